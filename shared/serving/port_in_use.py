"""A server's port held by another socket: the error every binding site raises, and the check
that finds it before anything slow starts.

`service` names what was to listen there ("grpc", "http", "metrics"; the KV listener raises
`transfer.errors.KvPortInUse`), so the command line can name the flag that moves it.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["PortInUse", "check_port_free", "port_taken"]


class PortInUse(OSError):
    def __init__(self, service: str, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"{service} port {host}:{port} is in use")
        self.service, self.host, self.port = service, host, port


def port_taken(host: str, port: int) -> bool:
    """Whether another socket holds `host`:`port`: a bind there fails with EADDRINUSE. gRPC and
    UCX report a failed bind without its reason; this asks the kernel directly."""
    if port <= 0:
        return False  # ephemeral: never taken
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror:
        return False  # a bad host is the server's own bind error to report
    with socket.socket(family, kind, proto) as probe:
        # as every server here binds: a port in TIME_WAIT is free to listen on
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_port_free(service: str, host: str, port: int) -> None:
    """Raise PortInUse now, before a node spends its start-up loading a model."""
    if port_taken(host, port):
        raise PortInUse(service, host, port)
