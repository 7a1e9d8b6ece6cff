"""Parsed flags into the objects the commands take: a config dataclass from the flags named
after its fields, and the TLS settings of a server or a client."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from shared.serving.tls import ClientTls, ServerTls

T = TypeVar("T")


def from_args(cls: type[T], a: argparse.Namespace, **overrides: Any) -> T:
    """A config dataclass from the flags named after its fields, plus `overrides` for the
    rest: each flag is mapped once, where it is declared (the `*_args` modules)."""
    flags = vars(a)
    given = {f.name: flags[f.name] for f in dataclasses.fields(cls) if f.name in flags}
    return cls(**{**given, **overrides})


def server_tls(a: argparse.Namespace) -> ServerTls | None:
    if not a.tls_cert and not a.tls_key:
        return None
    return ServerTls(a.tls_cert, a.tls_key, a.tls_client_ca)


def client_tls(a: argparse.Namespace, prefix: str) -> ClientTls | None:
    """From `tls_args.client_tls_args`' flags; None (plaintext) without a CA."""
    ca, cert, key = (getattr(a, f"{prefix}tls_{part}") for part in ("ca", "cert", "key"))
    return ClientTls(ca, cert, key) if ca else None
