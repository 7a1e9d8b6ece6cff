"""A prefill node's runtime LoRA updates (`LoadLoraAdapter` / `UnloadLoraAdapter`): what a decode
node's `POST /v1/load_lora_adapter` passes on, so that the prefill nodes serve the adapter too.
The same path as the decode node's own update (shared/serving/lora_admin.py): the files are read
and checked off the event loop, then the engine takes the adapter between two steps."""

from __future__ import annotations

import grpc

from proto.pdserve.v1 import prefill_pb2
from shared.engine.info import EngineInfo
from shared.engine.lora_updates import LoraUpdateError
from shared.engine.thread import EngineThread
from shared.serving import lora_admin

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}


async def load(
    thread: EngineThread, info: EngineInfo, allowed: bool, request, context
) -> prefill_pb2.LoraAdaptersResponse:
    await _check(info, allowed, request.lora_name, context)
    try:
        await lora_admin.load_lora(thread, info, request.lora_name, request.lora_path)
    except LoraUpdateError as e:
        await context.abort(_STATUS.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), str(e))
    return _served(info)


async def unload(
    thread: EngineThread, info: EngineInfo, allowed: bool, request, context
) -> prefill_pb2.LoraAdaptersResponse:
    await _check(info, allowed, request.lora_name, context)
    try:
        await lora_admin.unload_lora(thread, request.lora_name)
    except LoraUpdateError as e:
        await context.abort(_STATUS.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), str(e))
    return _served(info)


def _served(info: EngineInfo) -> prefill_pb2.LoraAdaptersResponse:
    return prefill_pb2.LoraAdaptersResponse(lora_adapters=sorted(info.lora_adapters))


async def _check(info: EngineInfo, allowed: bool, name: str, context) -> None:
    if not allowed:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "runtime LoRA updates are off on this prefill node: start it with "
            "--allow-runtime-lora (and --max-loras N)",
        )
    if info.loaded.model.lora is None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this prefill node has no LoRA adapter slots: start it with --max-loras N",
        )
    if not name:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is empty")
