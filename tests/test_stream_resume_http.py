"""HTTP streams that survive their node: through `pdserve up --decode 2`'s front door, a streamed
completion or chat answer whose decode node is SIGKILLed mid-stream is continued on the survivor
(pdserve/http_resume.py): the client's text, token count, usage and logprobs equal an undisturbed
run's, greedy and seeded alike, stop strings included; a non-streamed one is sent whole to the
survivor. Clients that never send the proxy's private header see the chunks they always saw.
Real processes, SmolLM2 (the reason is test_stream_resume.py's)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import httpx
import pytest

from pdserve.cluster import spawn, stop_all, wait_ready
from pdserve.http_resume import HttpLedger, ledger_for
from shared.engine.requests.output import OutputProcessor
from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.gguf_builtin import SMOLLM2_SPEC
from shared.model.loader import load_tokenizer_and_template
from shared.serving.http.sse import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER
from tests.test_stream_resume import BACK, _assert_conserved, _busiest, _node_http
from tests.up_process import Up, metrics

MAX_TOKENS = 28
PROMPTS = ["The history of the bicycle begins", "Three facts about the moon:"]
RESUMED = 'pdserve_proxy_resumes_total{outcome="completed"}'


def _chat(prompt: str) -> dict[str, Any]:
    """Greedy, streamed, usage at the end."""
    messages = [{"role": "user", "content": prompt}]
    return {"model": "smollm2", "messages": messages, "temperature": 0.0, **_common()}


def _completion(prompt: str, stop: list[str], seed: int) -> dict[str, Any]:
    """Seeded temperature 0.8 with nucleus, logprobs and stop strings."""
    fields = {"temperature": 0.8, "top_p": 0.95, "seed": seed, "logprobs": 2, "stop": stop}
    return {"model": "smollm2", "prompt": prompt, **fields, **_common()}


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _json_chat(prompt: str) -> dict[str, Any]:
    """Greedy under a JSON schema, ending where the grammar does."""
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    return {**_chat(prompt), "max_tokens": 80, "ignore_eos": False, "response_format": schema}


def _common() -> dict[str, Any]:
    usage = {"include_usage": True}
    return {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "stream_options": usage}


# ---- the node's continuation, on the engine's own output processor ---------------------------


def test_a_continued_answer_releases_exactly_the_text_the_first_call_did_not() -> None:
    """At every split point, multi-byte characters split across tokens and stop strings that
    begin before the split included: first call's text + continuation's text == the whole."""
    tok, _ = load_tokenizer_and_template(SMOLLM2_SPEC)
    prompt = tok.encode("Say:")
    answer = tok.encode(" héllo wörld 日本語 the END of 🙂 it STOP here more")

    def run(prompt: list[int], params: SamplingParams, tokens: list[int]) -> tuple[str, object]:
        processor = OutputProcessor(tok, frozenset())
        request = LlmRequest("r", prompt, params)
        processor.add(request)
        texts, reason = [], None
        for token in tokens:
            delta = processor.process(request, token)
            texts.append(delta.text)
            if (reason := delta.finish_reason) is not None:
                break
        return "".join(texts), reason

    for stop in [(), ("STOP",), ("END of",)]:
        params = SamplingParams(max_tokens=len(answer), stop=stop, ignore_eos=True)
        whole = run(prompt, params, answer)
        for k in range(1, len(answer)):
            first, reason = run(prompt, params, answer[:k])
            if reason is not None:
                continue  # finished before the split: nothing to continue
            rest = run(*params.continued(prompt, answer[:k]), answer[k:])
            assert (first + rest[0], rest[1]) == whole, (stop, k)
    with pytest.raises(ValueError, match="leaves none"):
        SamplingParams(max_tokens=3).continued(prompt, [1, 2, 3])


def test_the_ledger_makes_one_stream_of_two_calls() -> None:
    """Ids, created, the role chunk, usage and logprobs' text_offset, as the client sees them."""
    chat = HttpLedger(True, {"model": "m", "messages": [], "stream": True}, None)

    def chunk(rid: str, delta: dict[str, Any], ids: list[int] | None, **tail: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if ids is not None:
            choice[TOKEN_IDS_FIELD] = ids
        body = {"id": rid, "created": 7 if rid == "a" else 9, "choices": [choice], **tail}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode()

    role = {"role": "assistant", "content": ""}
    assert chat.record(chunk("a", role, None)) == chunk("a", role, None) + b"\n\n"
    assert (
        chat.record(chunk("a", {"content": "Hi"}, [5, 6]))
        == chunk("a", {"content": "Hi"}, None) + b"\n\n"
    )
    body = json.loads(chat.continuation())
    assert body["pdserve_continuation"] == [5, 6] and chat.resumes == 1
    assert chat.record(chunk("b", role, None)) == b""  # one role announcement per stream
    usage = {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}
    out = json.loads(chat.record(chunk("b", {"content": "!"}, [7], usage=usage))[6:])
    assert (out["id"], out["created"]) == ("a", 7)
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert TOKEN_IDS_FIELD not in out["choices"][0] and chat.sent == [5, 6, 7]


def test_only_one_plain_answer_is_resumable_and_its_deadline_travels() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    path = "/v1/chat/completions"

    def ledger(body: dict[str, Any], timeout: str | None = None) -> HttpLedger | None:
        return ledger_for("POST", path, json.dumps(body).encode(), timeout)

    assert ledger(chat) is not None
    for extra in [{"n": 2}, {"tools": [{"type": "function"}]}, {"functions": [{"name": "f"}]}]:
        assert ledger({**chat, **extra}) is None, extra
    # a grammar's state is rebuilt from the tokens sent: structured answers resume too
    for extra in [{"guided_regex": "a+"}, {"response_format": {"type": "json_object"}}]:
        assert ledger({**chat, **extra}) is not None, extra
    batch = {"model": "m", "prompt": ["a", "b"]}
    assert ledger_for("POST", "/v1/completions", json.dumps(batch).encode(), None) is None
    timed = ledger(chat, "30")
    assert timed is not None
    sent = dict(timed.headers([("x-request-timeout", "30"), ("accept", "*/*")]))
    assert 29 < float(sent["x-request-timeout"]) <= 30 and sent[TOKEN_IDS_HEADER] == "1"


# ---- through the front door, a node killed ---------------------------------------------------


@pytest.fixture
def up(smollm2_up2: Up) -> Up:
    """`pdserve up --model smollm2 --decode 2`, shared by the gRPC and HTTP resume tests."""
    return smollm2_up2


class Answer:
    """One streamed answer as its client saw it."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        choices = [c for e in events for c in e.get("choices", [])]
        self.ids = {e.get("id") for e in events}
        self.created = {e.get("created") for e in events}
        self.roles = sum(1 for c in choices if "role" in c.get("delta", {}))
        self.text = "".join(
            c.get("text") or c.get("delta", {}).get("content") or "" for c in choices
        )
        self.finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
        # cached tokens depend on what each node's prefix cache held: not compared
        self.usage = [{**e["usage"], "prompt_tokens_details": None} for e in events if "usage" in e]
        logprobs = [c["logprobs"] for c in choices if c.get("logprobs")]
        self.tokens = [t for lp in logprobs for t in lp.get("tokens", [])]
        self.offsets = [o for lp in logprobs for o in lp.get("text_offset", [])]
        self.errors = [e["error"] for e in events if "error" in e]
        self.leaked = any(TOKEN_IDS_FIELD in c for c in choices)

    @property
    def shown(self) -> tuple[object, ...]:
        """What an undisturbed run must equal."""
        return (self.text, self.finish, self.usage, self.tokens, self.offsets)


async def _stream(
    url: str, path: str, body: dict[str, Any], started: asyncio.Event | None = None, **headers: str
) -> tuple[Answer, list[bytes]]:
    """One streamed answer, and its raw events; it must end with data: [DONE]."""
    events: list[dict[str, Any]] = []
    raw: list[bytes] = []
    async with (
        httpx.AsyncClient(timeout=180) as client,
        client.stream("POST", url + path, json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            raw.append(line.encode())
            if line != "data: [DONE]":
                events.append(json.loads(line[6:]))
            if started is not None and len(events) >= 4:
                started.set()
    assert raw and raw[-1] == b"data: [DONE]", raw[-3:]
    return Answer(events), raw


def _stop_string(text: str) -> str:
    """A stop string first found late in `text`, so that it ends the answer there."""
    for i in range(len(text) * 2 // 3, len(text) - 4):
        if text[i] == " " and text.find(text[i : i + 5]) == i:
            return text[i : i + 5]
    raise AssertionError(f"no stop string to pick in {text!r}")


def _requests(up: Up) -> list[tuple[str, dict[str, Any]]]:
    """Two greedy chats and two seeded completions, each with a stop string that ends it, and a
    chat under a JSON schema."""
    plain = [("/v1/completions", _completion(p, [], 100 + i)) for i, p in enumerate(PROMPTS)]
    texts = [a.text for a in asyncio.run(_streams(up.http, plain))]
    out: list[tuple[str, dict[str, Any]]] = []
    for i, (prompt, text) in enumerate(zip(PROMPTS, texts, strict=True)):
        out.append(("/v1/chat/completions", _chat(prompt)))
        out.append(("/v1/completions", _completion(prompt, [_stop_string(text)], 100 + i)))
    out.append(("/v1/chat/completions", _json_chat("Name a large city and its population.")))
    return out


async def _streams(url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Answer]:
    """Undisturbed answers, all at once (each is what it would be alone: the kill test's own
    streams run side by side too)."""
    answers = await asyncio.gather(*(_stream(url, path, body) for path, body in requests))
    return [a for a, _ in answers]


def test_a_stream_whose_decode_node_is_killed_completes_on_the_survivor(up: Up) -> None:
    backs = up.log.read_text().count(BACK)  # restarts so far: others' too
    requests = _requests(up)
    reference = asyncio.run(_streams(up.http, requests))
    assert all(a.finish == ["stop"] for a in reference[1::2]), [a.finish for a in reference]
    assert reference[-1].finish == ["stop"] and json.loads(reference[-1].text), reference[-1].text
    whole = {**_completion(PROMPTS[0], [], 7), "stream": False, "stream_options": None}
    want = httpx.post(up.http + "/v1/completions", json=whole, timeout=120).json()
    before = metrics(up.http).get(RESUMED, 0.0)

    async def body() -> tuple[list[Answer], httpx.Response]:
        events = [asyncio.Event() for _ in requests]
        plain = asyncio.create_task(_post(up.http, whole))
        tasks = [
            asyncio.create_task(_stream(up.http, path, b, e))
            for (path, b), e in zip(requests, events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        os.kill(_busiest(up, up.http), signal.SIGKILL)
        return [a for a, _ in await asyncio.gather(*tasks)], await plain

    answers, got = asyncio.run(body())
    for answer, ref in zip(answers, reference, strict=True):
        assert not answer.errors and not answer.leaked
        assert len(answer.ids) == len(answer.created) == 1  # one stream, not two
        assert answer.roles == ref.roles  # one role announcement (chat), none (completions)
        assert answer.shown == ref.shown  # text, tokens, usage, logprobs
    assert got.status_code == 200, got.text
    assert _whole(got.json()) == _whole(want)
    assert metrics(up.http).get(RESUMED, 0.0) > before, "no stream was resumed"
    up.wait_log(BACK, count=backs + 1, timeout=180)
    _assert_conserved(up)


def _whole(answer: dict[str, Any]) -> tuple[object, ...]:
    """A non-streamed answer's text, tokens and counts (logprob values and cached tokens depend
    on the batch and the cache that served it)."""
    [choice], usage = answer["choices"], answer["usage"]
    counts = (usage["prompt_tokens"], usage["completion_tokens"])
    return choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"], counts


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=180) as client:
        return await client.post(url + "/v1/completions", json=body)


def test_clients_without_the_private_header_get_todays_chunks(up: Up) -> None:
    """A node adds the token ids only when asked; the proxy's chunks are the node's, byte for
    byte, but for the id and creation time."""
    node = _node_http(up)[0]
    path, body = "/v1/completions", _completion(PROMPTS[1], [], 3)
    plain, raw = asyncio.run(_stream(node, path, body))
    asked, _ = asyncio.run(_stream(node, path, body, **{TOKEN_IDS_HEADER: "1"}))
    assert not plain.leaked and b"pdserve" not in b"".join(raw)
    assert asked.leaked and asked.shown == plain.shown
    _, via_raw = asyncio.run(_stream(up.http, path, body))

    def masked(events: list[bytes]) -> list[object]:
        out = [json.loads(e[6:]) if e != b"data: [DONE]" else None for e in events]
        for e in out:
            if isinstance(e, dict):
                e["id"] = e["created"] = None
        return out

    assert masked(via_raw) == masked(raw)
    assert all(b"pdserve" not in e for e in via_raw)


def test_no_resume_left_ends_the_stream_with_an_error_event(up: Up) -> None:
    """A proxy with --max-resumes 0: the stream on the killed node ends with a 503 error event
    and [DONE]; the others complete."""
    backs = up.log.read_text().count(BACK)  # restarts so far: others' too
    nodes = _node_http(up)
    args = ["--backend", ",".join(up.decodes), "--port", "0", "--metrics-port", "0"]
    args += [
        "--http-port",
        "0",
        "--backend-http",
        ",".join(u.removeprefix("http://") for u in nodes),
    ]
    proxy = spawn("proxy", [*args, "--max-resumes", "0", "--health-interval", "1"], echo=False)
    try:
        wait_ready([proxy], 60)
        via = f"http://127.0.0.1:{proxy.info['http_port']}"

        async def body() -> list[Answer]:
            events = [asyncio.Event() for _ in PROMPTS]
            tasks = [
                asyncio.create_task(_stream(via, "/v1/chat/completions", _chat(p), e))
                for p, e in zip(PROMPTS, events, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            os.kill(_busiest(up, via), signal.SIGKILL)
            return [a for a, _ in await asyncio.gather(*tasks)]

        answers = asyncio.run(body())
        errors = [e for a in answers for e in a.errors]
        assert errors, "no stream was on the killed node"
        assert all("failed mid-stream" in e["message"] for e in errors), errors
        up.wait_log(BACK, count=backs + 1, timeout=180)
        _assert_conserved(up)
    finally:
        stop_all([proxy], grace=5)
