"""A KV transfer peer in its own interpreter, for tests/test_transfer.py.

UCX must not be initialised before a fork, so tests start peers as fresh processes
(`python -m tests.transfer_peer --role sender|receiver`) and drive them with one JSON command per
line on stdin; every reply is one line on stdout prefixed with REPLY_PREFIX (UCX may log too).

The sender's KV pool is a deterministic function of the layout and SEED (`sender_pool`), so the
test process can compute exactly what must land without shipping the data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import traceback
from typing import Any

import torch

from shared.engine.kv_cache import KvLayout, allocate_kv_pool
from transfer.env import configure_ucx_env

REPLY_PREFIX = "PEER-REPLY "
SEED = 1234
LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SENDER_BLOCKS = 16


def sender_pool(layout: KvLayout = LAYOUT, num_blocks: int = SENDER_BLOCKS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    pool = allocate_kv_pool(layout, num_blocks, "cpu")
    pool.copy_(torch.randn(pool.shape, generator=gen, dtype=torch.float32).to(pool.dtype))
    return pool


def dest_to_json(dest: Any) -> dict[str, Any]:
    return {
        "address": dest.address,
        "transfer_id": dest.transfer_id,
        "token": dest.token.hex(),
        "block_ids": list(dest.block_ids),
        "layout_fingerprint": dest.layout_fingerprint,
    }


def dest_from_json(obj: dict[str, Any]) -> Any:
    from transfer.protocol import TransferDestination

    return TransferDestination(
        address=obj["address"],
        transfer_id=obj["transfer_id"],
        token=bytes.fromhex(obj["token"]),
        block_ids=tuple(obj["block_ids"]),
        layout_fingerprint=obj["layout_fingerprint"],
    )


class SenderRole:
    def __init__(self) -> None:
        from transfer.ucx import KvSender

        self.pool = sender_pool()
        self.sender = KvSender(LAYOUT)
        self.raw_engine: Any = None
        self.raw_endpoints: dict[str, Any] = {}

    async def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """messages: [[layer, [src ids], [dst ids]], ...]. mode "blocks" (default): all posted
        at once straight from the pool, as the prefill node does on CPU; "packed": packed and
        sent one at a time."""
        from transfer.ucx import KvSender

        dest = dest_from_json(cmd["dest"])
        started = time.monotonic()
        wire = self.sender.bytes_sent_total
        messages = cmd["messages"]
        timeout = cmd.get("timeout")
        sent = 0
        posted = []
        for i, (layer, src, dst) in enumerate(messages):
            last = bool(cmd.get("last")) and i == len(messages) - 1
            if cmd.get("mode") == "packed":
                payload = KvSender.pack(self.pool, layer, src)
                sent += await self.sender.send(dest, layer, dst, payload, last, timeout)
            else:
                posted.append(
                    self.sender.post_blocks(dest, layer, dst, self.pool, src, last, timeout)
                )
        sent += sum(await asyncio.gather(*posted))
        return {
            "bytes": sent,
            "wire": self.sender.bytes_sent_total - wire,
            "seconds": time.monotonic() - started,
        }

    def _raw_endpoint(self, address: str) -> Any:
        from transfer.protocol import split_address
        from transfer.worker import UcxWorker

        if self.raw_engine is None:
            self.raw_engine = UcxWorker()
        if address not in self.raw_endpoints:
            self.raw_endpoints[address] = self.raw_engine.connect(*split_address(address))
        return self.raw_endpoints[address]

    def _post_raw(self, cmd: dict[str, Any]) -> list[asyncio.Future]:
        """Post cmd["messages"], [[tag, hex data], ...], back to back as they are."""
        import numpy as np

        ep = self._raw_endpoint(cmd["address"])
        sends = []
        for tag, data in cmd["messages"]:
            buf = np.frombuffer(bytes.fromhex(data), dtype=np.uint8).copy()
            sends.append(self.raw_engine.send(ep, buf, tag))  # keeps buf until UCX is done
        return sends

    async def raw(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send arbitrary bytes with arbitrary tags (forgeries, garbage)."""
        sends = self._post_raw(cmd)
        await asyncio.wait_for(asyncio.gather(*sends), 10)
        return {"messages": len(sends)}

    async def stall(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Post raw messages like `raw`, then stop this process (SIGSTOP) before UCX can move
        more than what the posting itself sends: a rendezvous payload stays half-way."""
        import os
        import signal

        self._raw_endpoint(cmd["address"])
        await asyncio.sleep(0.2)  # the endpoint's connection is up
        sends = self._post_raw(cmd)
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"messages": len(sends)}

    async def close(self) -> None:
        await self.sender.close()
        if self.raw_engine is not None:
            closing = [self.raw_engine.close_endpoint(ep) for ep in self.raw_endpoints.values()]
            await asyncio.wait(closing, timeout=2)
            self.raw_endpoints.clear()
            self.raw_engine.close()


class ReceiverRole:
    def __init__(self) -> None:
        from transfer.ucx import KvReceiver

        self.pool = allocate_kv_pool(LAYOUT, SENDER_BLOCKS, "cpu")
        self.receiver = KvReceiver(self.pool, LAYOUT)

    async def start(self) -> dict[str, Any]:
        await self.receiver.start()
        return {"address": self.receiver.address}

    async def expect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"dest": dest_to_json(self.receiver.expect("peer", cmd["blocks"]))}

    async def close(self) -> None:
        await self.receiver.close()


async def serve(role_name: str) -> None:
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, '{"op": "exit"}')

    threading.Thread(target=read_stdin, daemon=True).start()
    role: Any = SenderRole() if role_name == "sender" else ReceiverRole()
    if isinstance(role, ReceiverRole):
        reply({"ok": True, **(await role.start())})
    else:
        reply({"ok": True})
    while True:
        cmd = json.loads(await commands.get())
        op = cmd["op"]
        if op == "exit":
            await role.close()
            reply({"ok": True})
            return
        try:
            result = await getattr(role, op)(cmd)
            reply({"ok": True, **result})
        except Exception as e:  # reported to the test, which asserts on it
            reply(
                {
                    "ok": False,
                    "error": type(e).__name__,
                    "message": str(e),
                    "traceback": traceback.format_exc(),
                }
            )


def reply(obj: dict[str, Any]) -> None:
    print(REPLY_PREFIX + json.dumps(obj), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["sender", "receiver"], required=True)
    args = parser.parse_args()
    configure_ucx_env()
    asyncio.run(serve(args.role))


if __name__ == "__main__":
    main()
