"""The ports each `pdserve` command listens on, each named by the flag that sets it: checked
before the command starts anything slow, and the one line a port another socket holds gets."""

from __future__ import annotations

import argparse

from shared.serving.port_in_use import PortInUse, check_port_free
from transfer.errors import KvPortInUse

# the flag that moves each server's port: the same name on every command that has it
PORT_FLAGS = {
    "grpc": "--port",
    "http": "--http-port",
    "metrics": "--metrics-port",
    "ucx": "--ucx-port",
}
UP_PORT, UP_HTTP_PORT = 50051, 8000  # `pdserve up`'s first decode node's, without --run
_NODES = ("prefill", "decode", "colocated", "encode")


def up_ports(a: argparse.Namespace) -> tuple[int, int]:
    """`pdserve up`'s first decode node's gRPC and HTTP ports: the flags' if given, else the
    well-known ones; with --run ephemeral ones, since the demo's client finds them itself."""
    fixed = a.run is None
    port = a.port if a.port is not None else (UP_PORT if fixed else 0)
    http_port = a.http_port if a.http_port is not None else (UP_HTTP_PORT if fixed else 0)
    return port, http_port


def up_front_door(a: argparse.Namespace) -> bool:
    """Whether `pdserve up` starts a front door (a proxy) before its decode nodes: with more than
    one, unless --run's client talks to a node itself or TLS is on (the proxy speaks
    plaintext)."""
    return a.decode > 1 and a.run is None and not getattr(a, "tls_cert", "")


def bound_ports(a: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(service, host, port) of every port the command `a` will listen on (0: ephemeral, -1:
    off; both never taken)."""
    if a.command == "up":
        port, http_port = up_ports(a)
        return [
            (service, "127.0.0.1", first + i)
            # with more than one decode node the front door (a proxy) takes the first ports
            for i in range(a.decode + up_front_door(a))
            for service, first in (("grpc", port), ("http", http_port))
            if first > 0
        ]
    if a.command == "proxy":
        services = (("grpc", a.port), ("metrics", a.metrics_port), ("http", a.http_port))
        return [(service, a.host, port) for service, port in services]
    if a.command not in _NODES:
        return []
    ports = [("grpc", a.host, a.port), ("metrics", a.host, a.metrics_port)]
    if a.command not in ("prefill", "encode"):
        ports += [("http", a.host, a.http_port), ("ucx", a.ucx_bind or a.ucx_host, a.ucx_port)]
    return ports


def check_bound_ports(a: argparse.Namespace) -> None:
    """PortInUse for the first of `a`'s ports that another socket holds, before anything starts (a
    node would otherwise load its model first; gRPC and UCX would each log their own error)."""
    for service, host, port in bound_ports(a):
        check_port_free(service, host, port)


def port_in_use_line(e: PortInUse | KvPortInUse) -> str:
    return (
        f"pdserve: port {e.port} is in use ({PORT_FLAGS[e.service]}): choose another port or 0 "
        "for an ephemeral one"
    )
