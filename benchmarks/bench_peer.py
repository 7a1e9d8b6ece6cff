"""One side of `pdserve bench transfer`, in a fresh interpreter (UCX does not survive a fork):

    python -m benchmarks.bench_peer --role receiver|sender [--host ADVERTISED_ADDRESS]

Driven by `benchmarks.transfer` through `bench_util.PeerProcess` (one JSON command per line).
The receiver plays the decode node: a KV pool, a KvReceiver with reserved blocks, and the
baselines' landing sides (a raw UCX worker, a gRPC server, a NIXL agent), all writing into that
same pool. The sender plays the prefill node: a KV pool filled with a per-block byte pattern
(so the receiver can check where every block landed) and the sending side of every method.

Every method reports its start on the sender's `time.monotonic()` and its end on the side that
knows the bytes are in place; both processes share the host's monotonic clock (also across
network namespaces), so end - start is the end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from benchmarks.bench_util import peer_main_loop
from shared.engine.kv_cache import KvLayout, allocate_kv_pool
from shared.serving.limits import GRPC_CHANNEL_OPTIONS

GRPC_METHOD = "/pdbench.Kv/Push"
GRPC_CHUNK = 4 << 20  # bytes per gRPC message: gRPC's default message cap
GRPC_OPTIONS = GRPC_CHANNEL_OPTIONS
_CHUNK_HEAD = struct.Struct("<IQ")  # layer, byte offset inside that layer's payload
RAW_TAG = 0x5244  # tag of the one contiguous ucxx message
NIXL_NAMES = {"receiver": "pdbench-receiver", "sender": "pdbench-sender"}


def fill_pattern(pool: torch.Tensor) -> None:
    """Every byte of block b (all layers, K and V) is b % 251 + 1: where a block lands is
    checkable from one byte, and no block is all zeros like an untouched receiver pool."""
    raw = pool.view(torch.uint8)
    for b in range(pool.shape[2]):
        raw[:, :, b].fill_(b % 251 + 1)


def block_bytes(layout: KvLayout) -> int:
    """Bytes of K (or V) of one block in one layer: the unit a block descriptor covers."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * layout.itemsize


def flat_bytes(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(torch.uint8).reshape(-1)


def descriptor_addresses(
    base: int, layout: KvLayout, num_blocks: int, block_ids: list[int]
) -> np.ndarray:
    """Start address of every (layer, K/V, block) region of `block_ids`, in pool order."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    planes = np.arange(layout.num_layers * 2, dtype=np.uint64)[:, None] * np.uint64(num_blocks)
    return (np.uint64(base) + (planes + ids[None, :]) * np.uint64(block_bytes(layout))).ravel()


def _descs(addresses: np.ndarray, length: int) -> np.ndarray:
    n = len(addresses)
    return np.stack(
        [addresses, np.full(n, length, np.uint64), np.zeros(n, np.uint64)], axis=1
    ).astype(np.uint64)


# ---- receiver (decode side) ---------------------------------------------------------------------
class Receiver:
    def __init__(self, host: str):
        self.host = host
        self.layout: KvLayout | None = None
        self.pool: torch.Tensor | None = None
        self.kv: Any = None  # KvReceiver
        self.waits: dict[int, asyncio.Task[Any]] = {}
        self.raw_engine: Any = None
        self.raw_listener: Any = None
        self.raw_endpoints: list[Any] = []
        self.raw_probes: asyncio.Queue[Any] = asyncio.Queue()
        self.raw_waits: dict[int, asyncio.Task[float]] = {}
        self.grpc_server: Any = None
        self.grpc_port = 0
        self.grpc_staging: torch.Tensor | None = None
        self.nixl: Any = None
        self.nixl_reg: Any = None
        self.nixl_waits: dict[str, asyncio.Task[float]] = {}

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        return await getattr(self, "cmd_" + cmd.pop("cmd"))(**cmd)

    # -- pool and pdserve's KvReceiver
    async def cmd_setup(self, layout: dict[str, Any], num_blocks: int) -> dict[str, Any]:
        from transfer.ucx import KvReceiver

        await self.cmd_free()
        self.layout = KvLayout(**layout)
        self.pool = allocate_kv_pool(self.layout, num_blocks, "cpu")  # zeroed: pages touched
        self.kv = KvReceiver(self.pool, self.layout, self.host, 0)
        await self.kv.start()
        return {"address": self.kv.address}

    async def cmd_free(self) -> None:
        for task in [*self.waits.values(), *self.raw_waits.values(), *self.nixl_waits.values()]:
            task.cancel()
        self.waits.clear()
        self.raw_waits.clear()
        self.nixl_waits.clear()
        if self.nixl_reg is not None:
            self.nixl.deregister_memory(self.nixl_reg)
            self.nixl_reg = None
        if self.kv is not None:
            await self.kv.close()
            self.kv = None
        self.pool = self.grpc_staging = None

    async def cmd_expect(self, block_ids: list[int]) -> dict[str, Any]:
        dest = self.kv.expect("bench", block_ids)
        self.waits[dest.transfer_id] = asyncio.ensure_future(self.kv.wait(dest.transfer_id, 600))
        return {
            "dest": {
                "address": dest.address,
                "transfer_id": dest.transfer_id,
                "token": dest.token.hex(),
                "block_ids": list(dest.block_ids),
                "layout_fingerprint": dest.layout_fingerprint,
            }
        }

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

    # -- one contiguous ucxx message
    async def cmd_raw_start(self) -> dict[str, Any]:
        from transfer.worker import UcxWorker

        if self.raw_engine is None:
            self.raw_engine = UcxWorker()
            self.raw_listener = self.raw_engine.listen(
                self.host, 0, self.raw_endpoints.append, lambda ep: None
            )

            def drain() -> None:
                while (probe := self.raw_engine.probe()) is not None:
                    self.raw_probes.put_nowait(probe)

            self.raw_engine.add_hook(drain)
        return {"port": self.raw_listener.port}

    async def cmd_raw_expect(self, key: int) -> None:
        async def land() -> float:
            probe = await self.raw_probes.get()
            await self.raw_engine.recv_probed(probe, flat_bytes(self.pool))
            return time.monotonic()

        self.raw_waits[key] = asyncio.ensure_future(land())

    async def cmd_raw_result(self, key: int) -> dict[str, Any]:
        return {"end": await self.raw_waits.pop(key)}

    # -- gRPC, the naive baseline
    async def cmd_grpc_start(self) -> dict[str, Any]:
        import grpc
        from grpc import aio

        if self.grpc_server is None:
            server = aio.server(options=GRPC_OPTIONS)
            handler = grpc.method_handlers_generic_handler(
                "pdbench.Kv", {"Push": grpc.stream_unary_rpc_method_handler(self._grpc_push)}
            )
            server.add_generic_rpc_handlers((handler,))
            self.grpc_port = server.add_insecure_port("0.0.0.0:0")
            await server.start()
            self.grpc_server = server
        return {"port": self.grpc_port}

    async def _grpc_push(self, requests: Any, context: Any) -> bytes:
        """First message: the destination block ids (JSON); then (layer, offset, bytes) chunks,
        copied into a staging buffer and scattered into the pool once a layer is complete."""
        layout = self.layout
        dst: list[int] | None = None
        layer_bytes = 0
        index = None
        async for message in requests:
            if dst is None:
                dst = json.loads(message)
                layer_bytes = len(dst) * layout.block_bytes_per_layer
                index = torch.tensor(dst, dtype=torch.long)
                if self.grpc_staging is None or self.grpc_staging.numel() < layer_bytes:
                    self.grpc_staging = torch.empty(layer_bytes, dtype=torch.uint8)
                staging = self.grpc_staging.numpy()
                continue
            layer, offset = _CHUNK_HEAD.unpack_from(message)
            chunk = np.frombuffer(message, dtype=np.uint8, offset=_CHUNK_HEAD.size)
            staging[offset : offset + len(chunk)] = chunk
            if offset + len(chunk) == layer_bytes:
                payload = self.grpc_staging[:layer_bytes].view(self.pool.dtype)
                payload = payload.view(2, len(dst), *self.pool.shape[3:])
                self.pool[layer].index_copy_(1, index, payload)
        return struct.pack("<d", time.monotonic())

    # -- NIXL, the peer
    async def cmd_nixl_start(self) -> dict[str, Any]:
        from nixl._api import nixl_agent, nixl_agent_config

        if self.nixl is None:
            # no progress thread: it would spin a core of this 2-core box; the expect task below
            # polls notifications, which progresses the worker, as NIXL users' step loops do
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.nixl = nixl_agent(NIXL_NAMES["receiver"], config)
        if self.nixl_reg is None:
            self.nixl_reg = self.nixl.register_memory(self.pool)
        return {
            "metadata": self.nixl.get_agent_metadata().hex(),
            "base": self.pool.data_ptr(),
        }

    async def cmd_nixl_expect(self, tag: str) -> None:
        async def wait_notif() -> float:
            want = tag.encode()
            while True:
                for messages in self.nixl.get_new_notifs().values():
                    if want in messages:
                        return time.monotonic()
                await asyncio.sleep(0)

        self.nixl_waits[tag] = asyncio.ensure_future(wait_notif())

    async def cmd_nixl_result(self, tag: str) -> dict[str, Any]:
        return {"end": await asyncio.wait_for(self.nixl_waits.pop(tag), 600)}

    async def cmd_quit(self) -> None:
        await self.cmd_free()
        if self.grpc_server is not None:
            await self.grpc_server.stop(0)
        if self.raw_engine is not None:
            closing = [self.raw_engine.close_endpoint(ep) for ep in self.raw_endpoints]
            if closing:
                await asyncio.wait(closing, timeout=2)
            self.raw_listener.destroy()
            self.raw_listener = None
            self.raw_engine.close()


# ---- sender (prefill side) ----------------------------------------------------------------------
class Sender:
    def __init__(self) -> None:
        from transfer.ucx import KvSender

        self.layout: KvLayout | None = None
        self.pool: torch.Tensor | None = None
        self.kv = None
        self.kv_class = KvSender
        self.packer = ThreadPoolExecutor(1, thread_name_prefix="pack")  # the compute thread
        self.raw_engine: Any = None
        self.raw_endpoints: dict[str, Any] = {}
        self.channels: dict[str, Any] = {}
        self.nixl: Any = None
        self.nixl_reg: Any = None
        self.nixl_peer: str | None = None
        self.nixl_handle: Any = None
        self.copy_dst: torch.Tensor | None = None

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        return await getattr(self, "cmd_" + cmd.pop("cmd"))(**cmd)

    async def cmd_setup(self, layout: dict[str, Any], num_blocks: int) -> None:
        await self.cmd_free()
        self.layout = KvLayout(**layout)
        self.pool = allocate_kv_pool(self.layout, num_blocks, "cpu")
        fill_pattern(self.pool)
        if self.kv is None:
            self.kv = self.kv_class(self.layout)
        elif self.kv._layout != self.layout:
            await self.kv.close()
            self.kv = self.kv_class(self.layout)

    async def cmd_free(self) -> None:
        if self.nixl_handle is not None:
            self.nixl.release_xfer_handle(self.nixl_handle)
            self.nixl_handle = None
        if self.nixl_reg is not None:
            self.nixl.deregister_memory(self.nixl_reg)
            self.nixl_reg = None
        self.pool = self.copy_dst = None

    # -- the physical ceiling: one memcpy of the same bytes, on this side's one core
    async def cmd_memcpy(self) -> dict[str, Any]:
        src = flat_bytes(self.pool)
        if self.copy_dst is None:
            self.copy_dst = torch.ones_like(src)  # touched: no page faults in the timing
        started = time.perf_counter()
        self.copy_dst.copy_(src)
        return {"seconds": time.perf_counter() - started}

    # -- pdserve's push, as the prefill node does it
    async def cmd_send_kv(
        self, dest: dict[str, Any], src_ids: list[int], mode: str
    ) -> dict[str, Any]:
        """layerwise: every layer posted straight from the pool (no copy on this side), at most
        SEND_WINDOW messages in flight, like PrefillNode._drain. whole: one message for every
        layer (a whole-request push; also what a layer-wise push coalesces to when its queue is
        ahead of the sends). packed: every layer packed into a contiguous buffer first (the
        CUDA pools' path), then sent like layerwise."""
        from transfer.protocol import TransferDestination
        from transfer.sender import SEND_WINDOW

        target = TransferDestination(**{**dest, "token": bytes.fromhex(dest["token"])})
        layers = self.layout.num_layers
        dst = target.block_ids
        t0 = time.monotonic()
        payloads: list[torch.Tensor] = []
        if mode == "packed":
            payloads = [self.kv_class.pack(self.pool, layer, src_ids) for layer in range(layers)]
        packed = time.monotonic()
        in_flight: list[asyncio.Future[int]] = []
        if mode == "whole":
            await self.kv.post_blocks(target, 0, dst, self.pool, src_ids, True, n_layers=layers)
            return {
                "start": t0,
                "sent": time.monotonic(),
                "pack_s": 0.0,
                "send_s": time.monotonic() - packed,
            }
        for layer in range(layers):
            last = layer == layers - 1
            if mode == "packed":
                in_flight.append(self.kv.post(target, layer, dst, payloads[layer], last))
            else:
                in_flight.append(self.kv.post_blocks(target, layer, dst, self.pool, src_ids, last))
            if len(in_flight) >= SEND_WINDOW:
                await in_flight.pop(0)
        await asyncio.gather(*in_flight)
        return {
            "start": t0,
            "sent": time.monotonic(),
            "pack_s": packed - t0,
            "send_s": time.monotonic() - packed,
        }

    # -- one contiguous ucxx message of the whole payload
    async def cmd_send_raw(self, host: str, port: int) -> dict[str, Any]:
        from transfer.worker import UcxWorker

        if self.raw_engine is None:
            self.raw_engine = UcxWorker()
        key = f"{host}:{port}"
        if key not in self.raw_endpoints:
            self.raw_endpoints[key] = self.raw_engine.connect(host, port)
        buf = flat_bytes(self.pool)
        t0 = time.monotonic()
        await self.raw_engine.send(self.raw_endpoints[key], buf, RAW_TAG)
        return {"start": t0}

    # -- gRPC
    async def cmd_send_grpc(
        self, address: str, src_ids: list[int], dst_ids: list[int]
    ) -> dict[str, Any]:
        from grpc import aio

        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = aio.insecure_channel(address, options=GRPC_OPTIONS)
        call = channel.stream_unary(GRPC_METHOD)
        index = torch.tensor(src_ids, dtype=torch.long)
        pool = self.pool

        async def chunks() -> Any:
            yield json.dumps(dst_ids).encode()
            for layer in range(pool.shape[0]):
                payload = pool[layer].index_select(1, index).view(torch.uint8).reshape(-1)
                view = memoryview(payload.numpy())
                for offset in range(0, len(view), GRPC_CHUNK):
                    chunk = view[offset : offset + GRPC_CHUNK]
                    yield _CHUNK_HEAD.pack(layer, offset) + chunk.tobytes()

        t0 = time.monotonic()
        reply = await call(chunks(), timeout=600)
        return {"start": t0, "end": struct.unpack("<d", reply)[0]}

    # -- NIXL WRITE of the same block descriptors
    async def cmd_nixl_prepare(
        self, metadata: str, base: int, src_ids: list[int], dst_ids: list[int]
    ) -> dict[str, Any]:
        from nixl._api import nixl_agent, nixl_agent_config

        if self.nixl is None:
            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.nixl = nixl_agent(NIXL_NAMES["sender"], config)
        started = time.monotonic()
        if self.nixl_peer is not None:
            self.nixl.remove_remote_agent(self.nixl_peer)
        self.nixl_peer = self.nixl.add_remote_agent(bytes.fromhex(metadata))
        if self.nixl_reg is None:
            self.nixl_reg = self.nixl.register_memory(self.pool)
        if self.nixl_handle is not None:
            self.nixl.release_xfer_handle(self.nixl_handle)
        length = block_bytes(self.layout)
        n = self.pool.shape[2]
        local = _descs(descriptor_addresses(self.pool.data_ptr(), self.layout, n, src_ids), length)
        remote = _descs(descriptor_addresses(base, self.layout, n, dst_ids), length)
        self.nixl_handle = self.nixl.initialize_xfer(
            "WRITE",
            self.nixl.get_xfer_descs(local, "DRAM"),
            self.nixl.get_xfer_descs(remote, "DRAM"),
            self.nixl_peer,
        )
        return {"descriptors": len(local), "prepare_seconds": time.monotonic() - started}

    async def cmd_nixl_send(self, tag: str) -> dict[str, Any]:
        """Post the prepared WRITE and poll it to completion (NIXL's usage: the initiator
        polls; DONE means the data is in the remote memory)."""
        t0 = time.monotonic()
        state = self.nixl.transfer(self.nixl_handle, tag.encode())
        while state == "PROC":
            state = self.nixl.check_xfer_state(self.nixl_handle)
        done = time.monotonic()
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        return {"start": t0, "end": done}

    async def cmd_quit(self) -> None:
        await self.cmd_free()
        for channel in self.channels.values():
            await channel.close()
        if self.kv is not None:
            await self.kv.close()
        if self.raw_engine is not None:
            closing = [self.raw_engine.close_endpoint(ep) for ep in self.raw_endpoints.values()]
            if closing:
                await asyncio.wait(closing, timeout=2)
            self.raw_engine.close()
        self.packer.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description="a side of `pdserve bench transfer`")
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
