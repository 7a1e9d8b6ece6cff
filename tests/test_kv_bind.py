"""The KV listener binds the configured address, and UCX's own tcp sockets follow it."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import uvloop

from decode_node.config import DecodeNodeConfig
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool
from tests.net_probe import listening_sockets, tcp_connects
from transfer.env import configure_ucx_env, net_device_of
from transfer.errors import TransferError

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def _run(coro_fn):  # type: ignore[no-untyped-def]
    return uvloop.run(coro_fn())


def test_listener_binds_only_the_configured_address() -> None:
    from transfer.ucx import KvMessage, KvReceiver, KvSender

    pool = allocate_kv_pool(LAYOUT, 8, "cpu")
    source = allocate_kv_pool(LAYOUT, 8, "cpu")
    source.copy_(torch.randn(source.shape))

    async def main() -> None:
        receiver, sender = KvReceiver(pool, LAYOUT, host="127.0.0.1"), KvSender(LAYOUT)
        await receiver.start()
        try:
            ip, port = receiver.bound
            assert (ip, port) == ("127.0.0.1", int(receiver.address.rsplit(":", 1)[1]))
            assert ("127.0.0.1", port) in listening_sockets(os.getpid())
            assert ("0.0.0.0", port) not in listening_sockets(os.getpid())
            # The whole of 127/8 reaches this host; only the bound address answers.
            assert await asyncio.to_thread(tcp_connects, "127.0.0.1", port)
            assert not await asyncio.to_thread(tcp_connects, "127.0.0.2", port)
            # ...and it still takes KV over UCX.
            dest = receiver.expect("bound", [3, 5])
            landed = asyncio.ensure_future(receiver.wait(dest.transfer_id, 20))
            push = sender.open(dest)
            for layer in range(LAYOUT.num_layers):
                payload = KvSender.pack(source, layer, [0, 1])
                message = KvMessage(layer=layer, blocks=[3, 5], payload=payload, last=layer == 1)
                await push.send(message)
            await landed
            assert torch.equal(pool[:, :, [3, 5]], source[:, :, [0, 1]])
        finally:
            await sender.close()
            await receiver.close()
        assert not await asyncio.to_thread(tcp_connects, "127.0.0.1", port)  # closed for good

    _run(main)


def test_bind_every_interface_and_advertise_one() -> None:
    from transfer.ucx import KvReceiver

    async def main() -> None:
        pool = allocate_kv_pool(LAYOUT, 4, "cpu")
        receiver = KvReceiver(pool, LAYOUT, host="127.0.0.1", bind_host="0.0.0.0")
        await receiver.start()
        try:
            ip, port = receiver.bound
            assert ip == "0.0.0.0" and receiver.address == f"127.0.0.1:{port}"
            assert await asyncio.to_thread(tcp_connects, "127.0.0.2", port)
        finally:
            await receiver.close()

    _run(main)


def test_unusable_bind_address_is_a_clear_error() -> None:
    from transfer.ucx import KvReceiver

    async def main() -> None:
        pool = allocate_kv_pool(LAYOUT, 4, "cpu")
        # 192.0.2.0/24 is TEST-NET-1: no host owns .254, so bind() fails (EADDRNOTAVAIL)
        receiver = KvReceiver(pool, LAYOUT, host="192.0.2.254")
        with pytest.raises(TransferError, match=r"cannot listen for KV on 192\.0\.2\.254"):
            await receiver.start()
        await receiver.close()  # never started: a no-op

    _run(main)
    with pytest.raises(ValueError, match="--ucx-bind / --ucx-host: cannot resolve"):
        DecodeNodeConfig(prefill_targets=("p:1",), ucx_host="no-such-host.invalid").validate()
    DecodeNodeConfig(prefill_targets=("p:1",), ucx_bind_host="::").validate()


def test_ucx_net_devices_follow_the_bind_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert net_device_of("127.0.0.1") == "lo"
    assert net_device_of("0.0.0.0") is None and net_device_of("::") is None
    assert net_device_of("192.0.2.254") in (None, "")  # owned by no device here
    assert net_device_of("decode-0") is None  # names are not guessed at

    # setenv first, so that the teardown restores the original state even if it was unset
    monkeypatch.setenv("UCX_NET_DEVICES", "placeholder")
    monkeypatch.delenv("UCX_NET_DEVICES")
    configure_ucx_env(bind_host="127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")  # an operator's choice wins
    configure_ucx_env(bind_host="127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "eth7"
    monkeypatch.delenv("UCX_NET_DEVICES")
    configure_ucx_env(bind_host="0.0.0.0")
    assert "UCX_NET_DEVICES" not in os.environ
