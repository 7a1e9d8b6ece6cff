"""Streams that survive their node: `pdserve up --decode 2` serves one front door, and a decode
node SIGKILLed mid-stream costs its clients nothing: the proxy continues each of its streams on
the survivor (GenerateRequest.continuation), token for token what an undisturbed run gives,
greedy and seeded alike. Real processes, real gRPC, SmolLM2 (a random tiny model has exact ties
between logits, which the prefill and decode kernels' rounding may break either way)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time

import grpc
import httpx
import pytest

from pdserve.client import build_generate_request, generate, generate_stream
from pdserve.cluster import spawn, stop_all, wait_ready
from proto.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.engine.sampling.sampling_params import SamplingParams
from tests.net_probe import listening_sockets
from tests.up_process import Up, metrics

PROMPTS = [
    "The history of the bicycle begins",
    "Write a short poem about the sea.",
    "Three facts about the moon:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
]
MAX_TOKENS = 32
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension: every stream runs its full length
# greedy, and seeded at temperature 0.8 (with nucleus and top-k, which the resume keeps too)
SAMPLINGS = [
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.95, "top_k": 40},
]

BACK = " is back (restart"  # what `up` says of a node it restarted


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 + i, **SAMPLINGS[i % 2])


@pytest.fixture
def up(smollm2_up2: Up) -> Up:
    """`pdserve up --model smollm2 --decode 2`, shared by the gRPC and HTTP resume tests."""
    return smollm2_up2


def _node_http(up: Up) -> list[str]:
    """Each decode node's own http://HOST:PORT, in the order of `up.decodes`."""
    line = next(x for x in up.stdout if x.startswith("HTTP (OpenAI API): "))
    return re.findall(r"http://127\.0\.0\.1:\d+", line)[1:]


def _busiest(up: Up, proxy_metrics: str) -> int:
    """The pid of the decode node with the most of the proxy's calls in flight."""
    scrape = metrics(proxy_metrics)
    load = {t: scrape[f'pdserve_proxy_backend_inflight{{backend="{t}"}}'] for t in up.decodes}
    target = max(load, key=lambda t: load[t])
    assert load[target] > 0, f"no stream is in flight to interrupt: {load}"
    port = int(target.rpartition(":")[2])
    [pid] = [p for p in up.nodes("decode") if port in {q for _, q in listening_sockets(p)}]
    return pid


async def _undisturbed(target: str) -> list[tuple[list[int], int]]:
    """Each prompt's tokens and prompt tokens, nothing killed (all at once: each is what it
    would be alone, and the kill test's own streams run side by side too)."""
    results = await asyncio.gather(
        *(generate(target, p, _params(i)) for i, p in enumerate(PROMPTS))
    )
    return [(r.token_ids, r.usage.prompt_tokens) for r in results]


async def _streamed(target: str, i: int, started: asyncio.Event) -> tuple[list[int], int, int]:
    """One stream: its tokens, prompt tokens and completion tokens as its one final message says."""
    tokens: list[int] = []
    finals = []
    async with contextlib.aclosing(generate_stream(target, PROMPTS[i], _params(i))) as stream:
        async for msg in stream:
            tokens.extend(msg.token_ids)
            if msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                finals.append(msg.usage)
            if len(tokens) >= 4:
                started.set()
    [usage] = finals
    return tokens, usage.prompt_tokens, usage.completion_tokens


def test_up_prints_the_front_door_first_and_the_nodes_after(up: Up) -> None:
    line = next(x for x in up.stdout if x.startswith("endpoint: "))
    assert up.grpc not in up.decodes and len(up.decodes) == 2, line
    assert "front door" in line, line
    scrape = metrics(up.http)  # the front door's HTTP side answers /metrics too
    for node in up.decodes:
        assert scrape[f'pdserve_proxy_backend_healthy{{backend="{node}"}}'] == 1.0, scrape


def test_a_stream_whose_decode_node_is_killed_completes_on_the_survivor(up: Up) -> None:
    backs = up.log.read_text().count(BACK)  # restarts so far: others' too
    reference = asyncio.run(_undisturbed(up.grpc))

    async def each_node() -> list[list[int]]:  # the front door answers what each node answers
        answers = await asyncio.gather(*(generate(n, PROMPTS[0], _params(0)) for n in up.decodes))
        return [list(a.token_ids) for a in answers]

    assert asyncio.run(each_node()) == [reference[0][0]] * len(up.decodes)
    before = metrics(up.http).get('pdserve_proxy_resumes_total{outcome="completed"}', 0.0)

    async def body() -> tuple[list[tuple[list[int], int, int]], list[str]]:
        events = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(_streamed(up.grpc, i, e)) for i, e in enumerate(events)]
        http = [asyncio.create_task(_http_stream(up.http, p)) for p in PROMPTS[:4]]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        os.kill(_busiest(up, up.http), signal.SIGKILL)
        return await asyncio.gather(*tasks), await asyncio.gather(*http)

    results, http_outcomes = asyncio.run(body())
    # the HTTP streams beside them are resumed too (tests/test_stream_resume_http.py)
    assert set(http_outcomes) == {"complete"}, http_outcomes
    for (tokens, prompt_tokens, completion), (want, want_prompt) in zip(
        results, reference, strict=True
    ):
        assert tokens == want  # no repeated token, no gap, the same draws
        assert (prompt_tokens, completion) == (want_prompt, MAX_TOKENS)
    after = metrics(up.http)
    assert after.get('pdserve_proxy_resumes_total{outcome="completed"}', 0.0) > before, after
    up.wait_log(BACK, count=backs + 1, timeout=180)
    _assert_conserved(up)


async def _http_stream(url: str, prompt: str) -> str:
    """One streamed HTTP completion through the front door: "complete" or "error" (an error
    event, then [DONE]); a stream cut off without [DONE] fails the test."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 64, "stream": True, **IGNORE_EOS}
    events: list[str] = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events and events[-1] == "[DONE]", events[-3:]
    return "error" if '"error"' in events[-2] else "complete"


def _assert_conserved(up: Up, timeout: float = 30.0) -> None:
    """Every live decode node: no seat and no KV block still held."""
    deadline = time.monotonic() + timeout
    for url in _node_http(up):
        while True:
            m = metrics(url)
            held = [m["pdserve_seats_in_use"], m["pdserve_kv_blocks_in_use"]]
            held.append(m["pdserve_kv_blocks_pinned"])
            if not any(held):
                break
            assert time.monotonic() < deadline, f"decode node {url} still holds {held}"
            time.sleep(0.1)


async def _continue(target: str, done: list[int], **sampling: object) -> grpc.aio.AioRpcError:
    request = build_generate_request(PROMPTS[0], SamplingParams(**sampling), "")  # type: ignore[arg-type]
    request.continuation.ids.extend(done)
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request):
                pass
    return e.value


def test_the_continuation_field_is_checked_and_continues_the_answer(up: Up) -> None:
    node = up.decodes[0]
    whole = asyncio.run(generate(node, PROMPTS[1], _params(1)))
    request = build_generate_request(PROMPTS[1], _params(1), "")
    request.continuation.ids.extend(whole.token_ids[:10])

    async def rest() -> tuple[list[int], generation_pb2.Usage]:
        tokens: list[int] = []
        async with grpc.aio.insecure_channel(node) as channel:
            async for msg in generation_pb2_grpc.GenerationStub(channel).Generate(request):
                tokens.extend(msg.token_ids)
                usage = msg.usage
        return tokens, usage

    tokens, usage = asyncio.run(rest())
    assert tokens == whole.token_ids[10:]  # seeded draws continue at output index 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens + 10  # the node counts them as prompt
    e = asyncio.run(_continue(node, [5] * 8, max_tokens=8))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "continuation" in e.details()
    e = asyncio.run(_continue(node, [5], max_tokens=8, n=2))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "n > 1" in e.details()


def test_no_resume_left_ends_the_stream_unavailable(up: Up) -> None:
    """A proxy with --max-resumes 0 passes the lost node's error on: a clean UNAVAILABLE."""
    backs = up.log.read_text().count(BACK)  # restarts so far: others' too
    args = ["--backend", ",".join(up.decodes), "--port", "0", "--metrics-port", "0"]
    args += ["--max-resumes", "0"]
    proxy = spawn("proxy", [*args, "--health-interval", "1"], echo=False)
    try:
        wait_ready([proxy], 60)
        via = f"127.0.0.1:{proxy.info['port']}"

        async def body() -> list[BaseException | tuple[list[int], int, int]]:
            events = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(_streamed(via, i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            scrape = f"http://127.0.0.1:{proxy.info['metrics_port']}"
            os.kill(_busiest(up, scrape), signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(body())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors, "no stream was on the killed node"
        for e in errors:
            assert isinstance(e, grpc.aio.AioRpcError), e
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        up.wait_log(BACK, count=backs + 1, timeout=180)
    finally:
        stop_all([proxy], grace=5)


def test_a_deadline_that_passes_during_a_resume_is_deadline_exceeded(up: Up) -> None:
    """Streams too long for their deadline: the killed node's are resumed, and the deadline,
    carried to the survivor, still ends every stream DEADLINE_EXCEEDED; nothing stays held."""
    backs = up.log.read_text().count(BACK)  # restarts so far: others' too
    resumed_before = up.log.read_text().count("resuming on another node")
    long = SamplingParams(max_tokens=600, ignore_eos=True, temperature=0.8, seed=5)

    async def one(i: int, started: asyncio.Event) -> grpc.StatusCode:
        tokens = 0
        try:
            async for msg in generate_stream(up.grpc, PROMPTS[i], long, timeout=8.0):
                tokens += len(msg.token_ids)
                if tokens >= 4:
                    started.set()
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    async def body() -> list[grpc.StatusCode]:
        events = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(one(i, e)) for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        os.kill(_busiest(up, up.http), signal.SIGKILL)
        return await asyncio.gather(*tasks)

    codes = asyncio.run(body())
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * len(PROMPTS), codes
    assert up.log.read_text().count("resuming on another node") > resumed_before
    up.wait_log(BACK, count=backs + 1, timeout=180)
    _assert_conserved(up)
