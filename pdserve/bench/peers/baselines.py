"""The baselines `pdserve bench transfer` compares pdserve's push with, both sides: one contiguous
ucxx message, gRPC streaming, NIXL WRITE and a memcpy. Mixed into the transfer peer's roles
(`pdserve.bench.peers.transfer_peer`), whose pool they read from and land in."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from typing import Any

import numpy as np
import torch

from shared.kv.layout import KvLayout
from shared.serving.limits import GRPC_CHANNEL_OPTIONS

GRPC_METHOD = "/pdbench.Kv/Push"
GRPC_CHUNK = 4 << 20  # bytes per gRPC message: gRPC's default message cap
GRPC_OPTIONS = GRPC_CHANNEL_OPTIONS
_CHUNK_HEAD = struct.Struct("<IQ")  # layer, byte offset inside that layer's payload
RAW_TAG = 0x5244  # tag of the one contiguous ucxx message
NIXL_NAMES = {"receiver": "pdbench-receiver", "sender": "pdbench-sender"}


def ucxx_init(mode: str) -> Any:
    """ucxx's async API in progress `mode` (thread, thread+future, polling, blocking)."""
    import ucxx

    ucxx.init(progress_mode=mode.removesuffix("+future"), enable_python_future="future" in mode)
    return ucxx


def flat_bytes(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(torch.uint8).reshape(-1)


def _descs(base: int, layout: KvLayout, num_blocks: int, block_ids: list[int]) -> np.ndarray:
    """One NIXL descriptor (address, length, device) per (layer, K/V, block) of `block_ids`."""
    offsets, lengths = layout.block_spans(num_blocks, 0, layout.num_layers, block_ids, merge=False)
    n = len(offsets)
    addresses = np.uint64(base) + offsets.astype(np.uint64)
    return np.stack([addresses, lengths.astype(np.uint64), np.zeros(n, np.uint64)], axis=1)


class ReceiverBaselines:
    """The landing sides; the role provides host, layout and pool."""

    host: str
    layout: KvLayout | None
    pool: torch.Tensor | None

    def __init__(self) -> None:
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
        self.ucxx: Any = None
        self.ucxx_listener: Any = None
        self.ucxx_done: asyncio.Future[dict[str, float]] | None = None

    def free_baselines(self) -> None:
        for task in [*self.raw_waits.values(), *self.nixl_waits.values()]:
            task.cancel()
        self.raw_waits.clear()
        self.nixl_waits.clear()
        if self.nixl_reg is not None:
            self.nixl.deregister_memory(self.nixl_reg)
            self.nixl_reg = None
        self.grpc_staging = None

    async def close_baselines(self) -> None:
        if self.ucxx_listener is not None:
            self.ucxx_listener.close()
            self.ucxx.stop_notifier_thread()
        if self.grpc_server is not None:
            await self.grpc_server.stop(0)
        if self.raw_engine is not None:
            closing = [self.raw_engine.close_endpoint(ep) for ep in self.raw_endpoints]
            if closing:
                await asyncio.wait(closing, timeout=2)
            self.raw_listener.destroy()
            self.raw_listener = None
            self.raw_engine.close()

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

    # -- ucxx's own async API, how the progress engine was chosen (pdserve.bench.progress_modes)
    async def cmd_ucxx_listen(self, mode: str, nbytes: int, iters: int) -> dict[str, Any]:
        """Listen with ucxx in `mode` and take `iters` messages of `nbytes` from one endpoint;
        the first receive is posted at once, which is how this API waits for a message."""
        import numpy as np

        self.ucxx = ucxx = ucxx_init(mode)
        done = self.ucxx_done = asyncio.get_running_loop().create_future()

        async def handler(ep: Any) -> None:
            cpu, wall = time.process_time(), time.monotonic()
            buf = np.empty(nbytes, dtype=np.uint8)
            await ep.recv(buf, tag=7, force_tag=True)
            idle = 100 * (time.process_time() - cpu) / (time.monotonic() - wall)
            for _ in range(iters - 1):
                await ep.recv(buf, tag=7, force_tag=True)
            await ep.send(np.zeros(1, dtype=np.uint8), tag=8, force_tag=True)
            done.set_result({"idle_cpu": idle})

        self.ucxx_listener = ucxx.create_listener(handler, port=0)
        return {"port": self.ucxx_listener.port}

    async def cmd_ucxx_result(self) -> dict[str, Any]:
        result = await asyncio.wait_for(self.ucxx_done, 600)
        await asyncio.sleep(0.5)  # let the handler return before the listener goes
        return result

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
                layer_bytes = layout.payload_bytes(1, len(dst))
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
                payload = payload.view(layout.payload_shape(1, len(dst))[1:])
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


class SenderBaselines:
    """The sending sides; the role provides layout and pool."""

    layout: KvLayout | None
    pool: torch.Tensor | None

    def __init__(self) -> None:
        self.raw_engine: Any = None
        self.raw_endpoints: dict[str, Any] = {}
        self.channels: dict[str, Any] = {}
        self.nixl: Any = None
        self.nixl_reg: Any = None
        self.nixl_peer: str | None = None
        self.nixl_handle: Any = None
        self.copy_dst: torch.Tensor | None = None

    def free_baselines(self) -> None:
        if self.nixl_handle is not None:
            self.nixl.release_xfer_handle(self.nixl_handle)
            self.nixl_handle = None
        if self.nixl_reg is not None:
            self.nixl.deregister_memory(self.nixl_reg)
            self.nixl_reg = None
        self.copy_dst = None

    async def close_baselines(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        if self.raw_engine is not None:
            closing = [self.raw_engine.close_endpoint(ep) for ep in self.raw_endpoints.values()]
            if closing:
                await asyncio.wait(closing, timeout=2)
            self.raw_engine.close()

    def raw_endpoint(self, host: str, port: int) -> Any:
        """A UcxWorker endpoint to `host`:`port`, connected once."""
        from transfer.worker import UcxWorker

        if self.raw_engine is None:
            self.raw_engine = UcxWorker()
        key = f"{host}:{port}"
        if key not in self.raw_endpoints:
            self.raw_endpoints[key] = self.raw_engine.connect(host, port)
        return self.raw_endpoints[key]

    # -- the physical ceiling: one memcpy of the same bytes, on this side's one core
    async def cmd_memcpy(self) -> dict[str, Any]:
        src = flat_bytes(self.pool)
        if self.copy_dst is None:
            self.copy_dst = torch.ones_like(src)  # touched: no page faults in the timing
        started = time.perf_counter()
        self.copy_dst.copy_(src)
        return {"seconds": time.perf_counter() - started}

    # -- one contiguous ucxx message of the whole payload
    async def cmd_send_raw(self, host: str, port: int) -> dict[str, Any]:
        endpoint = self.raw_endpoint(host, port)
        buf = flat_bytes(self.pool)
        t0 = time.monotonic()
        await self.raw_engine.send(endpoint, buf, RAW_TAG)
        return {"start": t0, "sent": time.monotonic()}

    async def cmd_ucxx_send(
        self, mode: str, host: str, port: int, nbytes: int, iters: int, wait_s: float
    ) -> dict[str, Any]:
        """After `wait_s` (the receiver's idle reading), send `iters` messages of `nbytes`
        back to back with ucxx in `mode`; returns each one's send time."""
        import numpy as np

        ucxx = ucxx_init(mode)
        ep = await ucxx.create_endpoint(host, port)
        buf = np.ones(nbytes, dtype=np.uint8)
        await asyncio.sleep(wait_s)
        seconds = []
        for _ in range(iters):
            started = time.perf_counter()
            await ep.send(buf, tag=7, force_tag=True)
            seconds.append(time.perf_counter() - started)
        await ep.recv(np.empty(1, dtype=np.uint8), tag=8, force_tag=True)
        await ep.close()
        ucxx.stop_notifier_thread()
        return {"seconds": seconds}

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
        n = self.pool.shape[2]
        local = _descs(self.pool.data_ptr(), self.layout, n, src_ids)
        remote = _descs(base, self.layout, n, dst_ids)
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
