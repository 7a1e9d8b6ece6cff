"""A node's runtime LoRA updates (the HTTP API's load and unload routes on a decode or colocated
node, the LoadLoraAdapter / UnloadLoraAdapter RPCs on a prefill node): the adapter's files are
read and checked against the base model on a worker thread (they are I/O, and a large adapter
takes a while), then the engine puts it in a slot between two steps
(shared/engine/lora_updates.py)."""

from __future__ import annotations

import asyncio

from shared.engine.commands import LoadLora, UnloadLora
from shared.engine.info import EngineInfo
from shared.engine.lora_updates import LoraUpdateError, slots_of
from shared.engine.thread import EngineThread
from shared.model.lora_adapter import AdapterError
from shared.model.lora_install import read_lora


async def load_lora(thread: EngineThread, info: EngineInfo, name: str, path: str) -> None:
    model = info.loaded.model
    bank = slots_of(model.lora)  # before reading anything
    try:
        adapter = await asyncio.to_thread(read_lora, name, path, model, bank.max_rank)
    except AdapterError as e:
        raise LoraUpdateError(400, str(e)) from None
    await thread.call(LoadLora(adapter))


async def unload_lora(thread: EngineThread, name: str) -> None:
    await thread.call(UnloadLora(name))
