"""What the proxy keys a call's prompt on, for cache-aware routing: a chain of block hashes.

The proxy has no tokenizer. A prompt given as token ids is keyed like the engine keys its prefix
cache (chained hashes of `TOKEN_BLOCK`-token blocks); a prompt given as text is keyed on the text
itself, its UTF-8 bytes cut into `TEXT_CHUNK_BYTES`-byte chunks and chain-hashed: equal text
tokenizes equally, so a shared text prefix predicts a shared cached prefix (SGLang's cache-aware
router works on text the same way). A chat request is keyed on its messages serialized in order
(role, then content), which is how the chat template lays them out: a conversation that grows by
turns keeps its earlier turns' chunks. A Responses API request is keyed as the chat request it
runs as (`instructions` a system message first, `input` a user message or its items in order):
text turns key alike in both APIs. One continuing a stored response (`previous_response_id`)
has no key: only the replica holding that response can serve it. Lengths are in `units`, about
a token each (text: one unit per `BYTES_PER_UNIT` bytes), so text and token prompts weigh alike
in the cost.

Anything that is not a well-formed prompt gives no key (None): such a call is still forwarded
untouched (the decode node answers the error) and routed least-loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from proto.pdserve.v1 import generation_pb2
from shared.serving.prefix_index import prompt_hashes, text_hashes

TOKEN_BLOCK = 16  # tokens per key block (the decode nodes' usual KV block size)
TEXT_CHUNK_BYTES = 64  # bytes of text per key block: about TOKEN_BLOCK tokens
BYTES_PER_UNIT = TEXT_CHUNK_BYTES // TOKEN_BLOCK  # ~4 bytes of text per token
# a key covers at most this many blocks: one huge prompt must not flush the whole index
MAX_KEY_BLOCKS = 4096
GENERATE_METHOD = "/pdserve.v1.Generation/Generate"


@dataclass(frozen=True)
class PromptKey:
    hashes: tuple[bytes, ...]  # the chain, TOKEN_BLOCK units per block
    units: int  # the prompt's length, in units (~tokens)


def token_key(ids: Sequence[int]) -> PromptKey:
    head = list(ids[: MAX_KEY_BLOCKS * TOKEN_BLOCK])
    return PromptKey(tuple(prompt_hashes(head, TOKEN_BLOCK)), len(ids))


def text_key(text: str, domain: bytes = b"text") -> PromptKey | None:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not text the backend accepts either
        return None
    hashes = text_hashes(data, TEXT_CHUNK_BYTES, domain, MAX_KEY_BLOCKS)
    return PromptKey(tuple(hashes), -(-len(data) // BYTES_PER_UNIT))


def grpc_key(method: str, request: bytes | None) -> PromptKey | None:
    """The prompt of a `Generate` call's request message; None for any other method."""
    if method != GENERATE_METHOD or request is None:
        return None
    try:
        message = generation_pb2.GenerateRequest.FromString(request)
    except DecodeError:
        return None
    which = message.WhichOneof("prompt")
    if which == "text":
        return text_key(message.text)
    if which == "token_ids":
        return token_key(message.token_ids.ids)
    return None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def completion_key(body: dict[str, object]) -> PromptKey | None:
    """`/v1/completions`: a string, a token list, or a list of either (the first is keyed)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str | list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_key(prompt)
    if _is_ids(prompt) and prompt:
        return token_key(prompt)  # type: ignore[arg-type]
    return None


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: the text ones as they read, others as JSON
        return "".join(
            p["text"]
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else json.dumps(p, sort_keys=True)
            for p in content
        )
    return "" if content is None else json.dumps(content, sort_keys=True)


def chat_key(body: dict[str, object]) -> PromptKey | None:
    """`/v1/chat/completions`: the messages in order, each its role then its content (unit and
    record separators between, so no two conversations serialize alike)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        parts.append(f"{m['role']}\x1f{_content_text(m.get('content'))}\x1e")
    return text_key("".join(parts), domain=b"chat")


def _item_message(item: object) -> dict[str, object] | None:
    """A Responses `input` item as the chat message it becomes (calls and their outputs as the
    assistant's and the tool's)."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message")
    if kind == "message":
        return item
    if kind == "function_call":
        return {"role": "assistant", "content": [item]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output")}
    return None


def responses_key(body: dict[str, object]) -> PromptKey | None:
    """`/v1/responses`: as chat_key keys the chat request it runs as."""
    if body.get("previous_response_id") is not None:
        return None
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list):
        return None
    messages = [_item_message(item) for item in items]
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.insert(0, {"role": "system", "content": instructions})
    return chat_key({"messages": messages})


HTTP_KEYS: dict[str, Callable[[dict[str, object]], PromptKey | None]] = {
    "/v1/completions": completion_key,
    "/v1/chat/completions": chat_key,
    "/v1/responses": responses_key,
}


def http_key(method: str, path: str, body: bytes) -> PromptKey | None:
    """The prompt of an OpenAI completion or chat request body; None for anything else."""
    keyer = HTTP_KEYS.get(path)
    if keyer is None or method != "POST":
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None
    return keyer(parsed) if isinstance(parsed, dict) else None
