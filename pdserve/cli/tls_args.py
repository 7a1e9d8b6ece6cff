"""The TLS flags of the gRPC commands: a node's as a server, and a client's (a decode node
calling its prefill nodes, `pdserve generate`)."""

from __future__ import annotations

import argparse


def server_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (gRPC)")
    g.add_argument("--tls-cert", default="", help="server certificate (PEM); enables TLS")
    g.add_argument("--tls-key", default="", help="server private key (PEM)")
    g.add_argument("--tls-client-ca", default="", help="require client certs signed by this CA")


def client_tls_args(p: argparse.ArgumentParser, prefix: str, ca_help: str) -> None:
    """--{prefix}tls-ca/-cert/-key: how this process, as a gRPC client, verifies and proves."""
    p.add_argument(f"--{prefix}tls-ca", default="", help=ca_help)
    p.add_argument(f"--{prefix}tls-cert", default="", help="client certificate (mutual TLS)")
    p.add_argument(f"--{prefix}tls-key", default="", help="client key (mutual TLS)")
