"""Each server's own bind, on a port another socket holds, says so by name: the HTTP/metrics
server (uvicorn on the node's loop), the gRPC server and the UCX KV listener. The command line
checks its ports before it starts (tests/test_first_run.py); these are the binds themselves, for
a port taken between that check and the bind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette

from shared.serving.grpc_server import create_grpc_server
from shared.serving.metrics import AsgiServer
from shared.serving.port_in_use import PortInUse, port_taken
from transfer.errors import KvPortInUse, TransferError


@pytest.fixture
def held() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_taken_sees_a_listener_on_any_address(held: int) -> None:
    assert port_taken("127.0.0.1", held) and port_taken("0.0.0.0", held)
    assert not port_taken("127.0.0.1", 0) and not port_taken("127.0.0.1", -1)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert not port_taken("127.0.0.1", port)


@pytest.mark.parametrize("service", ["http", "metrics"])
def test_asgi_server_names_its_service(held: int, service: str) -> None:
    async def start() -> None:
        await AsgiServer.start(Starlette(), "127.0.0.1", held, service=service)

    with pytest.raises(PortInUse) as e:
        asyncio.run(start())
    assert (e.value.service, e.value.port) == (service, held)


def test_grpc_server_bind_says_the_port_is_in_use(held: int) -> None:
    async def create() -> None:
        create_grpc_server([], lambda server: None, "127.0.0.1", held)

    with pytest.raises(PortInUse) as e:
        asyncio.run(create())
    assert (e.value.service, e.value.port) == ("grpc", held)


def test_grpc_server_bind_that_fails_otherwise_is_no_port_in_use() -> None:
    async def create() -> None:
        # an address of no interface here (TEST-NET-1): EADDRNOTAVAIL, nothing sent anywhere
        create_grpc_server([], lambda server: None, "192.0.2.1", 50999)

    with pytest.raises(OSError) as e:
        asyncio.run(create())
    assert not isinstance(e.value, PortInUse)


def test_kv_listener_says_the_port_is_in_use(held: int) -> None:
    from transfer.listener import KvListener

    async def listen() -> None:
        KvListener(asyncio.get_running_loop(), "127.0.0.1", held)

    with pytest.raises(KvPortInUse) as e:
        asyncio.run(listen())
    assert (e.value.service, e.value.port) == ("ucx", held)
    assert isinstance(e.value, TransferError)  # a listener's restart loop still retries it
