"""LoRA adapters loaded and unloaded at run time, as vLLM spells it: `POST /v1/load_lora_adapter`
`{"lora_name": ..., "lora_path": ...}` and `POST /v1/unload_lora_adapter` `{"lora_name": ...}`.

Only on a node started with `--allow-runtime-lora` (the path names a directory on the node's
own disk, so like every route they sit behind `--api-key` when one is set). The adapter is read
and checked against the base model off the event loop, then put in a free slot between two
engine steps; `/v1/models` lists it from then on. Unloading waits for nothing: it is refused
while a request of the adapter is live. A decode node passes each update on to its prefill
nodes (decode_node/prefill_lora.py); the answer names those that did not follow it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from shared.engine.lora_updates import LoraUpdateError
from shared.serving.http.errors import ApiError
from shared.serving.http.service import Backend


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what pdserve keys on


def install_lora_routes(app: FastAPI, backend: Backend, base_name: str) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> PlainTextResponse:
        if body.lora_name == base_name:
            raise ApiError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            missed = await backend.load_lora(body.lora_name, body.lora_path)
        except LoraUpdateError as e:
            raise ApiError(e.status, str(e), param="lora_path") from None
        text = f"Success: LoRA adapter '{body.lora_name}' added successfully."
        return PlainTextResponse(
            text
            + _prefill_note(
                missed, "load it (its prompts are prefilled on the nodes that did, or on this one)"
            )
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> PlainTextResponse:
        try:
            missed = await backend.unload_lora(body.lora_name)
        except LoraUpdateError as e:
            raise ApiError(e.status, str(e), param="lora_name") from None
        text = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        return PlainTextResponse(
            text + _prefill_note(missed, "unload it (no request is sent to it for the adapter)")
        )


def _prefill_note(missed: list[str], what: str) -> str:
    """The prefill nodes that did not follow the update: said, not an error (this node did)."""
    return f" Prefill nodes that did not {what}: {'; '.join(missed)}." if missed else ""
