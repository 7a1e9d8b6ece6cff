"""A colocated pdserve node: one process, one EngineCore doing prefill and decode, serving the
same public `Generation` gRPC service as a decode node. pdserve itself has no such server; the
serving and TTFT benchmarks need one so that the colocated baseline goes through the same client,
the same gRPC stack and the same process model as the P/D cluster.

    python -m benchmarks.peers.colocated --model tiny --port 0 [engine flags of `pdserve decode`]

Prints the same `PDSERVE_READY {...}` line as the nodes. Timing in the final message: queue =
arrival -> first scheduled, prefill = first scheduled -> first token, kv_transfer = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import uvloop

from pdserve.cli import _engine_args, _engine_config  # the nodes' own engine flags
from pdserve.nodes import announce, setup_logging
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestRejected
from shared.engine.output import TokenDelta
from shared.engine.request import FinishReason, LlmRequest
from shared.engine.thread import EngineThread
from shared.serving.grpc_server import create_grpc_server, model_info, set_serving
from shared.serving.wire import sampling_from_proto

log = logging.getLogger("pdserve.colocated")
SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}


class ColocatedNode(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: EngineConfig, host: str, port: int):
        self.core = EngineCore(config)
        self.host, self.requested_port = host, port
        self.port = 0
        self.streams: dict[str, asyncio.Queue[TokenDelta]] = {}
        self.thread: EngineThread | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.thread = EngineThread(
            self.core, asyncio.get_running_loop(), self._on_deltas, name="colocated-engine"
        )
        self.thread.start()
        self.server, self.health, self.port = create_grpc_server(
            [SERVICE],
            lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(self, s),
            self.host,
            self.requested_port,
        )
        await self.server.start()
        set_serving(self.health, [SERVICE], True)

    async def stop(self) -> bool:
        set_serving(self.health, [SERVICE], False)
        if self.server is not None:
            await self.server.stop(1.0)
        assert self.thread is not None
        await self.thread.call(lambda core: core.shutdown())
        self.thread.stop()
        return True

    def _on_deltas(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            queue = self.streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    async def GetModelInfo(self, request, context):
        return model_info(self.core, generation_pb2.NODE_ROLE_COLOCATED)

    async def Generate(self, request, context):
        arrival = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        prompt = (
            self.core.tokenizer.encode(request.text)
            if request.WhichOneof("prompt") == "text"
            else list(request.token_ids.ids)
        )
        params = sampling_from_proto(request.sampling)
        if rid in self.streams:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid!r} already in flight")
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.streams[rid] = queue
        try:
            try:
                req = await self.thread.call(lambda core: core.add_request(prompt, params, rid))
            except RequestRejected as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            async for message in self._stream(req, queue, arrival, len(prompt)):
                yield message
        finally:
            self.streams.pop(rid, None)
            with contextlib.suppress(RuntimeError):
                await self.thread.call(lambda core: core.abort(rid))

    async def _stream(
        self, req: LlmRequest, queue: asyncio.Queue[TokenDelta], arrival: float, prompt_len: int
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        first_at: float | None = None
        produced = 0
        while True:
            delta = await queue.get()
            first_at = first_at or time.monotonic()
            produced += len(delta.token_ids)
            msg = generation_pb2.GenerateResponse(
                request_id=req.request_id, token_ids=delta.token_ids, text=delta.text
            )
            if delta.finish_reason is None:
                yield msg
                continue
            msg.finish_reason = _FINISH[delta.finish_reason]
            msg.usage.CopyFrom(
                generation_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=produced)
            )
            scheduled = req.first_scheduled_time or arrival
            msg.timing.CopyFrom(
                generation_pb2.Timing(
                    queue_seconds=max(0.0, scheduled - req.arrival_time),
                    prefill_seconds=max(0.0, (req.first_token_time or scheduled) - scheduled),
                    kv_transfer_seconds=0.0,
                    time_to_first_token_seconds=first_at - arrival,
                    e2e_seconds=time.monotonic() - arrival,
                )
            )
            yield msg
            return


def main() -> int:
    parser = argparse.ArgumentParser(description="a colocated node (benchmark baseline)")
    _engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    a = parser.parse_args()
    setup_logging(a.log_level)

    async def run() -> int:
        node = ColocatedNode(_engine_config(a), a.host, a.port)
        await node.start()
        announce("colocated", port=node.port)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await stopping.wait()
        await node.stop()
        return 0

    return uvloop.run(run())


if __name__ == "__main__":
    raise SystemExit(main())
