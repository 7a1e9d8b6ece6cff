"""The KV transfer peer: one side of a transfer in a fresh interpreter (UCX does not survive a
fork), for `pdserve bench transfer`, `pdserve.bench.progress_modes` and tests/test_transfer.py:

    python -m pdserve.bench.peers.transfer_peer --role receiver|sender [--host ADVERTISED_ADDRESS]

Driven through `pdserve.bench.support.util.PeerProcess` (one JSON command per stdin line, one reply
per command behind REPLY_PREFIX). `setup` gives a role its KV pool. The receiver plays the decode
node: a KvReceiver with reserved blocks, and the baselines' landing sides (raw UCX, gRPC, NIXL:
`pdserve.bench.peers.baselines`), all writing into that pool. The sender plays the prefill node: a
pool filled with a per-block byte pattern (where every block landed is checkable from one byte)
or with seeded random values (`sender_pool`: the driver recomputes what must land), pdserve's push
and the baselines' sending sides, plus hand-made messages (`raw`, `stall`) for the tests.

Every method reports its start on the sender's `time.monotonic()` and its end on the side that
knows the bytes are in place; both processes share the host's monotonic clock (also across
network namespaces), so end - start is the end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pdserve.bench.peers.baselines import ReceiverBaselines, SenderBaselines
from pdserve.bench.support.util import peer_main_loop
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool

SEED = 1234


def fill_pattern(pool: torch.Tensor) -> None:
    """Every byte of block b (all layers, K and V) is b % 251 + 1: where a block lands is
    checkable from one byte, and no block is all zeros like an untouched receiver pool."""
    raw = pool.view(torch.uint8)
    for b in range(pool.shape[2]):
        raw[:, :, b].fill_(b % 251 + 1)


def sender_pool(layout: KvLayout, num_blocks: int) -> torch.Tensor:
    """The sender's pool with fill "random": a deterministic function of layout and SEED, so a
    driver knows every byte (of every layer) that must land without shipping it."""
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
        "sender_instance": dest.sender_instance,
        "receiver_instance": dest.receiver_instance,
    }


def dest_from_json(obj: dict[str, Any]) -> Any:
    from transfer.protocol import TransferDestination

    return TransferDestination(**{**obj, "token": bytes.fromhex(obj["token"])})


class _Role:
    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        return await getattr(self, "cmd_" + cmd.pop("cmd"))(**cmd)


# ---- receiver (decode side) ---------------------------------------------------------------------
class Receiver(_Role, ReceiverBaselines):
    def __init__(self, host: str):
        super().__init__()
        self.host = host
        self.layout: KvLayout | None = None
        self.pool: torch.Tensor | None = None
        self.kv: Any = None  # KvReceiver
        self.waits: dict[int, asyncio.Task[Any]] = {}

    async def cmd_setup(self, layout: dict[str, Any], num_blocks: int) -> dict[str, Any]:
        from transfer.ucx import KvReceiver

        await self.cmd_free()
        self.layout = KvLayout(**layout)
        self.pool = allocate_kv_pool(self.layout, num_blocks, "cpu")  # zeroed: pages touched
        self.kv = KvReceiver(self.pool, self.layout, self.host, 0)
        await self.kv.start()
        return {"address": self.kv.address}

    async def cmd_free(self) -> None:
        for task in self.waits.values():
            task.cancel()
        self.waits.clear()
        self.free_baselines()
        if self.kv is not None:
            await self.kv.close()
            self.kv = None
        self.pool = None

    async def cmd_expect(self, block_ids: list[int]) -> dict[str, Any]:
        dest = self.kv.expect("bench", block_ids)
        self.waits[dest.transfer_id] = asyncio.ensure_future(self.kv.wait(dest.transfer_id, 600))
        return {"dest": dest_to_json(dest)}

    async def cmd_result(self, transfer_id: int) -> dict[str, Any]:
        stats = await self.waits.pop(transfer_id)
        return {
            "end": stats.completed_at,
            "first_landed": stats.first_message_at,
            "bytes": stats.bytes,
            "messages": stats.messages,
        }

    async def cmd_zero(self) -> None:
        self.pool.zero_()

    async def cmd_verify(self, src_ids: list[int], dst_ids: list[int]) -> dict[str, Any]:
        """Did block src_ids[i] land in dst_ids[i], in every layer, K and V, first and last
        byte?"""
        raw = self.pool.view(torch.uint8)
        expected = torch.tensor([s % 251 + 1 for s in src_ids], dtype=torch.uint8)
        index = torch.tensor(dst_ids, dtype=torch.long)
        first = raw[:, :, :, 0, 0, 0].index_select(2, index)
        last = raw[:, :, :, -1, -1, -1].index_select(2, index)
        ok = bool((first == expected).all() and (last == expected).all())
        return {"correct": ok}

    async def cmd_idle(self, seconds: float, expect: bool) -> dict[str, Any]:
        """CPU this process uses while nothing arrives; `expect`: with a transfer registered and
        waited for (a decode node waiting on a slow prefill)."""
        tid = None
        if expect:
            dest = self.kv.expect("idle", [0])
            tid = dest.transfer_id
            waiter = asyncio.ensure_future(self.kv.wait(tid, 600))
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        percent = 100 * (time.process_time() - cpu) / (time.monotonic() - wall)
        if tid is not None:
            self.kv.cancel(tid)
            await asyncio.gather(waiter, return_exceptions=True)
        return {"cpu_percent": percent}

    async def cmd_quit(self) -> None:
        await self.cmd_free()
        await self.close_baselines()


# ---- sender (prefill side) ----------------------------------------------------------------------
class Sender(_Role, SenderBaselines):
    def __init__(self) -> None:
        super().__init__()
        self.layout: KvLayout | None = None
        self.pool: torch.Tensor | None = None
        self.kv: Any = None  # KvSender
        self.packer = ThreadPoolExecutor(1, thread_name_prefix="pack")  # the compute thread
        self.pushes: dict[int, Any] = {}  # transfer id -> KvPush: seqs go on across commands

    async def cmd_setup(
        self, layout: dict[str, Any], num_blocks: int, fill: str = "pattern", instance_id: int = 0
    ) -> None:
        from transfer.ucx import KvSender

        await self.cmd_free()
        self.layout = KvLayout(**layout)
        if fill == "random":
            self.pool = sender_pool(self.layout, num_blocks)
        else:
            self.pool = allocate_kv_pool(self.layout, num_blocks, "cpu")
            fill_pattern(self.pool)
        if self.kv is not None and (self.kv.layout, self.kv.instance_id) != (
            self.layout,
            instance_id,
        ):
            await self.kv.close()
            self.kv = None
        if self.kv is None:
            self.kv = KvSender(self.layout, instance_id=instance_id)

    async def cmd_free(self) -> None:
        self.free_baselines()
        self.pushes.clear()
        self.pool = None

    # -- pdserve's push, as the prefill node does it
    async def cmd_send_kv(
        self, dest: dict[str, Any], src_ids: list[int], mode: str
    ) -> dict[str, Any]:
        """layerwise: the layers posted straight from the pool (no copy on this side), held
        until they add up to the sender's measured min_message_bytes (prefill_node/push.py), at
        most SEND_WINDOW messages in flight, like PrefillNode._drain. whole: one message for every
        layer (a whole-request push; also what a layer-wise push coalesces to when its queue is
        ahead of the sends). packed: every layer packed into a contiguous buffer first (the
        CUDA pools' path), then sent like layerwise."""
        from transfer.sender import SEND_WINDOW, KvMessage, KvSender

        target = dest_from_json(dest)
        layers = self.layout.num_layers
        dst = target.block_ids
        t0 = time.monotonic()
        payloads: list[torch.Tensor] = []
        if mode == "packed":
            payloads = [KvSender.pack(self.pool, layer, src_ids) for layer in range(layers)]
        packed = time.monotonic()
        in_flight: list[asyncio.Future[int]] = []
        push = self.kv.open(target, self.pool)
        if mode == "whole":
            await push.send(KvMessage(layer=0, blocks=dst, src=src_ids, n_layers=layers, last=True))
            return {
                "start": t0,
                "sent": time.monotonic(),
                "pack_s": 0.0,
                "send_s": time.monotonic() - packed,
                "min_message_bytes": self.kv.min_message_bytes,
            }
        src, run, held = tuple(src_ids), 0, 0  # the layers held back (prefill_node/push.py)
        layer_bytes = self.layout.payload_bytes(1, len(src))
        for layer in range(layers):
            last = layer == layers - 1
            if mode == "packed":
                message = KvMessage(layer=layer, blocks=dst, payload=payloads[layer], last=last)
            else:
                held += layer_bytes
                if not last and held < self.kv.min_message_bytes:
                    continue  # coalesced with the next layers, as the prefill node does
                n = layer + 1 - run
                message = KvMessage(layer=run, blocks=dst, src=src, n_layers=n, last=last)
                run, held = layer + 1, 0
            in_flight.append(push.post(message))
            if len(in_flight) >= SEND_WINDOW:
                await in_flight.pop(0)
        await asyncio.gather(*in_flight)
        return {
            "start": t0,
            "sent": time.monotonic(),
            "pack_s": packed - t0,
            "send_s": time.monotonic() - packed,
            "min_message_bytes": self.kv.min_message_bytes,
        }

    # -- the tests' messages: exact layers and blocks, hand-made headers, a sender that stops
    async def cmd_send(
        self,
        dest: dict[str, Any],
        messages: list[list[Any]],
        mode: str = "blocks",
        last: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """messages: [[layer, [src ids], [dst ids]], ...]. mode "blocks": all posted at once
        straight from the pool, as the prefill node does on CPU; "packed": packed and sent one
        at a time. `last` marks the final one."""
        from transfer.ucx import KvMessage, KvSender

        target = dest_from_json(dest)
        push = self.pushes.get(target.transfer_id) or self.kv.open(target, self.pool)
        self.pushes[target.transfer_id] = push
        started, wire = time.monotonic(), self.kv.bytes_sent_total
        sent = 0
        posted = []
        for i, (layer, src, dst) in enumerate(messages):
            final = last and i == len(messages) - 1
            if mode == "packed":
                payload = KvSender.pack(self.pool, layer, src)
                message = KvMessage(layer=layer, blocks=dst, payload=payload, last=final)
                sent += await push.send(message, timeout=timeout)
            else:
                message = KvMessage(layer=layer, blocks=dst, src=src, last=final)
                posted.append(push.post(message, timeout=timeout))
        sent += sum(await asyncio.gather(*posted))
        return {
            "bytes": sent,
            "wire": self.kv.bytes_sent_total - wire,
            "seconds": time.monotonic() - started,
        }

    def _post_raw(self, address: str, messages: list[list[Any]]) -> list[asyncio.Future]:
        """Post [[tag, hex data], ...] back to back as they are."""
        from transfer.protocol import split_address

        endpoint = self.raw_endpoint(*split_address(address))
        sends = []
        for tag, data in messages:
            buf = np.frombuffer(bytes.fromhex(data), dtype=np.uint8).copy()
            sends.append(self.raw_engine.send(endpoint, buf, tag))  # keeps buf until UCX is done
        return sends

    async def cmd_raw(self, address: str, messages: list[list[Any]]) -> dict[str, Any]:
        """Send arbitrary bytes with arbitrary tags (forgeries, garbage)."""
        sends = self._post_raw(address, messages)
        await asyncio.wait_for(asyncio.gather(*sends), 10)
        return {"messages": len(sends)}

    async def cmd_stall(self, address: str, messages: list[list[Any]]) -> dict[str, Any]:
        """Post raw messages like `raw`, then stop this process (SIGSTOP) before UCX can move
        more than what the posting itself sends: a rendezvous payload stays half-way."""
        from transfer.protocol import split_address

        self.raw_endpoint(*split_address(address))
        await asyncio.sleep(0.2)  # the endpoint's connection is up
        sends = self._post_raw(address, messages)
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"messages": len(sends)}

    async def cmd_quit(self) -> None:
        await self.cmd_free()
        await self.close_baselines()
        if self.kv is not None:
            await self.kv.close()
        self.packer.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description="one side of a KV transfer")
    parser.add_argument("--role", choices=["receiver", "sender"], required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address the receiver advertises")
    a = parser.parse_args()
    from transfer.env import configure_ucx_env

    configure_ucx_env()  # before ucxx is imported: same settings as the nodes
    torch.set_num_threads(1)  # one core per side, like a node pinned to its core
    holder: dict[str, Any] = {}

    async def handle(cmd: dict[str, Any]) -> dict[str, Any] | None:
        if "side" not in holder:
            holder["side"] = Receiver(a.host) if a.role == "receiver" else Sender()
        return await holder["side"].handle(cmd)

    peer_main_loop(handle)


if __name__ == "__main__":
    main()
