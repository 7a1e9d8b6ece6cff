"""gRPC TLS for the public endpoint and between nodes (server certs, optional client certs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {path!r} does not exist")
    return p.read_bytes()


@dataclass(frozen=True)
class ServerTls:
    """A node's serving identity; with `client_ca`, callers must present a certificate it signed
    (mutual TLS, for the internal Prefill service)."""

    cert: str
    key: str
    client_ca: str = ""

    def validate(self) -> None:
        _read(self.cert, "TLS certificate")
        _read(self.key, "TLS key")
        if self.client_ca:
            _read(self.client_ca, "TLS client CA")

    def credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))]
        if self.client_ca:
            return grpc.ssl_server_credentials(
                pair,
                root_certificates=_read(self.client_ca, "TLS client CA"),
                require_client_auth=True,
            )
        return grpc.ssl_server_credentials(pair)


@dataclass(frozen=True)
class ClientTls:
    """How a caller verifies a node (CA) and, for mutual TLS, proves who it is."""

    ca: str
    cert: str = ""
    key: str = ""

    def validate(self) -> None:
        _read(self.ca, "TLS CA")
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS client certificate needs both cert and key")
        if self.cert:
            _read(self.cert, "TLS client certificate")
            _read(self.key, "TLS client key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "TLS CA"),
            private_key=_read(self.key, "TLS client key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS client certificate") if self.cert else None,
        )
