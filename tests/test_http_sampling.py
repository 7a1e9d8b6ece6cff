"""The sampling features on the OpenAI HTTP API (logprobs, echo, prompt_logprobs, n, penalties,
logit_bias, min_tokens, stop_token_ids, seed) against an in-process P/D cluster (real uvicorn,
gRPC and UCX, a tiny fp32 transformers checkpoint): the same tokens and logprobs as the same
SamplingParams through gRPC and the colocated LLM (and so transformers' log_softmax), in OpenAI's
shapes, parsed by the official `openai` SDK. After each test every seat and block is back on
both nodes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from shared.engine.config import EngineConfig
from shared.engine.core import RequestOutput
from shared.engine.llm import LLM
from shared.engine.sampling.logprobs import TokenLogprobs
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.engine_helpers import chat_checkpoint, random_prompts
from tests.sampling_reference import hf_log_softmax, pd_generate
from tests.support.cluster import PdCluster, pd_cluster

MESSAGES = [{"role": "user", "content": "the cat sat on"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_checkpoint(checkpoint("llama"), tmp_path_factory.mktemp("sampling") / "llama-chat")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(model_dir), num_kv_blocks=512), load_model(str(model_dir)))


@pytest.fixture
def run(model_dir: Path):
    """Run `body(cluster, http, sdk)` against a fresh 1 prefill + 1 decode cluster."""

    def runner(body) -> None:
        async def main() -> None:
            async with pd_cluster(model_dir, decode_overrides={"http_port": 0}) as cluster:
                url = f"http://127.0.0.1:{cluster.decodes[0].http_port}"
                async with (
                    httpx.AsyncClient(base_url=url, timeout=120) as http,
                    openai.AsyncOpenAI(
                        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120
                    ) as sdk,
                ):
                    await body(cluster, http, sdk)
                await cluster.assert_idle_and_conserved()

        asyncio.run(main())

    return runner


def _name(model_dir: Path) -> str:
    return load_model(str(model_dir)).name


async def _post(http: httpx.AsyncClient, path: str, **fields: object) -> dict:
    resp = await http.post(path, json=fields)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _text(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def _assert_completion_logprobs(
    llm: LLM, got: dict, ids: list[int], want: list[TokenLogprobs | None], k: int
) -> None:
    """The legacy completions object against the engine's entries (None: no logprob)."""
    assert got["tokens"] == [_text(llm, t) for t in ids]
    offsets = [sum(len(t) for t in got["tokens"][:i]) for i in range(len(ids))]
    assert got["text_offset"] == offsets
    for lp, top, w in zip(got["token_logprobs"], got["top_logprobs"], want, strict=True):
        if w is None:
            assert lp is None and top is None
            continue
        assert abs(lp - w.logprob) < TOL
        expect = {_text(llm, t): v for t, v in w.top[:k]}
        if w.token_id not in [t for t, _ in w.top[:k]]:
            expect.setdefault(_text(llm, w.token_id), w.logprob)
        assert list(top) == list(expect)  # most likely first, the chosen token last if extra
        assert all(abs(top[key] - expect[key]) < TOL for key in expect)


def _assert_chat_logprobs(llm: LLM, content: list, want: list[TokenLogprobs], k: int) -> None:
    assert len(content) == len(want)
    for entry, w in zip(content, want, strict=True):
        assert entry["token"] == _text(llm, w.token_id)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert abs(entry["logprob"] - w.logprob) < TOL
        tops = entry["top_logprobs"]
        assert [t["token"] for t in tops] == [_text(llm, t) for t, _ in w.top[:k]]
        assert all(abs(t["logprob"] - v) < TOL for t, (_, v) in zip(tops, w.top, strict=False))


def _assert_same_entries(a: list[dict], b: list[dict]) -> None:
    """Chat logprob entries equal up to float noise (a batch's sums may round differently)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x["token"], x["bytes"]) == (y["token"], y["bytes"])
        assert abs(x["logprob"] - y["logprob"]) < TOL
        xs, ys = x["top_logprobs"], y["top_logprobs"]
        assert [t["token"] for t in xs] == [t["token"] for t in ys]
        assert all(abs(u["logprob"] - v["logprob"]) < TOL for u, v in zip(xs, ys, strict=True))


def _sse(raw: bytes) -> list[dict]:
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [json.loads(e[len(b"data: ") :]) for e in events[:-1]]


def test_logprobs_equal_grpc_llm_and_transformers(run, llm: LLM, model_dir: Path) -> None:
    name = _name(model_dir)
    prompt = random_prompts(1, 500, min_len=9, max_len=9, seed=21)[0]
    greedy = SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True)
    [want] = llm.generate([prompt], greedy)
    assert want.logprobs is not None
    reference = hf_log_softmax(model_dir, prompt + want.token_ids)
    chat_ids = llm.tokenizer.encode(
        load_model(str(model_dir)).chat_template.render(MESSAGES, add_generation_prompt=True),
        add_special_tokens=False,
    )
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=2, ignore_eos=True)
    [chat_want] = llm.generate([chat_ids], seeded)

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        out = await _post(
            http,
            "/v1/completions",
            model=name,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            logprobs=3,
            ignore_eos=True,
        )
        choice = out["choices"][0]
        assert choice["text"] == want.text
        _assert_completion_logprobs(llm, choice["logprobs"], want.token_ids, want.logprobs, 3)
        # transformers: position len(prompt) - 1 + i predicts generated token i
        for i, lp in enumerate(choice["logprobs"]["token_logprobs"]):
            ref = reference[len(prompt) - 1 + i, want.token_ids[i]].item()
            assert abs(lp - ref) < TOL
        [grpc] = await pd_generate(cluster.targets[0], prompt, greedy)
        assert grpc.token_ids == want.token_ids
        _assert_completion_logprobs(llm, choice["logprobs"], grpc.token_ids, grpc.logprobs, 3)

        chat = await _post(
            http,
            "/v1/chat/completions",
            model=name,
            messages=MESSAGES,
            max_tokens=6,
            temperature=1.0,
            seed=5,
            logprobs=True,
            top_logprobs=2,
            ignore_eos=True,
        )
        assert chat["choices"][0]["message"]["content"] == chat_want.text
        assert chat_want.logprobs is not None
        _assert_chat_logprobs(llm, chat["choices"][0]["logprobs"]["content"], chat_want.logprobs, 2)
        # logprobs asked without alternatives: top_logprobs empty
        bare = await _post(
            http,
            "/v1/chat/completions",
            model=name,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            logprobs=True,
        )
        content = bare["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(c["top_logprobs"] == [] for c in content)
        plain = await _post(http, "/v1/completions", model=name, prompt=prompt, max_tokens=2)
        assert plain["choices"][0]["logprobs"] is None
        assert "prompt_logprobs" not in plain["choices"][0]

    run(body)


def test_echo_with_logprobs_gives_the_prompts_logprobs(run, llm: LLM, model_dir: Path) -> None:
    name = _name(model_dir)
    text = "the cat sat on the mat"
    prompt = llm.tokenizer.encode(text)
    params = SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    [want] = llm.generate([prompt], params)
    assert want.prompt_logprobs is not None and want.logprobs is not None
    reference = hf_log_softmax(model_dir, prompt)
    fields = {
        "model": name,
        "prompt": text,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        choice = (await _post(http, "/v1/completions", **fields))["choices"][0]
        assert choice["text"] == text + want.text
        ids = prompt + want.token_ids
        entries = [*want.prompt_logprobs, *want.logprobs]
        assert entries[0] is None  # the first prompt token has no logprob (vLLM: null)
        _assert_completion_logprobs(llm, choice["logprobs"], ids, entries, 2)
        for pos in range(1, len(prompt)):
            ref = reference[pos - 1, prompt[pos]].item()
            assert abs(choice["logprobs"]["token_logprobs"][pos] - ref) < TOL

        # streamed: the same text and logprobs, the prompt's on the first chunk
        resp = await http.post("/v1/completions", json={**fields, "stream": True})
        chunks = _sse(resp.content)
        assert chunks[0]["choices"][0]["text"].startswith(text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        streamed = [c["choices"][0]["logprobs"] for c in chunks]
        for key in ("tokens", "text_offset"):
            assert [v for part in streamed for v in part[key]] == choice["logprobs"][key]
        values = [v for part in streamed for v in part["token_logprobs"]]
        assert values[0] is None and choice["logprobs"]["token_logprobs"][0] is None
        whole = choice["logprobs"]["token_logprobs"]
        assert all(abs(u - v) < TOL for u, v in zip(values[1:], whole[1:], strict=True))

        # vLLM's prompt_logprobs: {id: {logprob, rank, decoded_token}} per token, first null
        out = await _post(
            http,
            "/v1/completions",
            model=name,
            prompt=text,
            max_tokens=2,
            temperature=0,
            prompt_logprobs=2,
        )
        got = out["choices"][0]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for pos in range(1, len(prompt)):
            w = want.prompt_logprobs[pos]
            assert w is not None
            entry = got[pos]
            assert next(iter(entry)) == str(prompt[pos])
            assert abs(entry[str(prompt[pos])]["logprob"] - w.logprob) < TOL
            for rank, (t, v) in enumerate(w.top[:2], 1):
                assert entry[str(t)]["rank"] == rank and abs(entry[str(t)]["logprob"] - v) < TOL
        assert out["choices"][0]["text"] == want.text[: len(out["choices"][0]["text"])]

        # n = 2: every choice echoes the prompt with its logprobs (computed once, on choice 0)
        both = await _post(http, "/v1/completions", **{**fields, "n": 2, "temperature": 1.0})
        for c in both["choices"]:
            assert c["text"].startswith(text)
            lps = c["logprobs"]
            assert lps["tokens"][: len(prompt)] == choice["logprobs"]["tokens"][: len(prompt)]
            head = lps["token_logprobs"][: len(prompt)]
            echoed = choice["logprobs"]["token_logprobs"][1 : len(prompt)]
            assert head[0] is None
            assert all(abs(u - v) < TOL for u, v in zip(head[1:], echoed, strict=True))

    run(body)


def _choices(outs: list[RequestOutput]) -> list[tuple[str, list[int]]]:
    return [(o.text, o.token_ids) for o in outs]


def test_seeded_n_equals_llm_token_for_token(run, llm: LLM, model_dir: Path) -> None:
    name = _name(model_dir)
    prompts = random_prompts(2, 500, min_len=5, max_len=30, seed=8)
    params = SamplingParams(
        max_tokens=10,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=7,
        n=4,
        logprobs=0,
        ignore_eos=True,
    )
    want = llm.generate(prompts, params)  # prompt i's completions at i * 4 + j
    assert len({tuple(o.token_ids) for o in want[:4]}) > 1  # each completion its own stream
    chat_ids = llm.tokenizer.encode(
        load_model(str(model_dir)).chat_template.render(MESSAGES, add_generation_prompt=True),
        add_special_tokens=False,
    )
    chat_want = llm.generate(
        [chat_ids],
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=1, ignore_eos=True),
    )

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        out = await _post(
            http,
            "/v1/completions",
            model=name,
            prompt=prompts,
            max_tokens=10,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            seed=7,
            n=4,
            best_of=4,
            logprobs=0,
            ignore_eos=True,
        )
        assert [c["index"] for c in out["choices"]] == list(range(8))
        for c, w in zip(out["choices"], want, strict=True):
            assert c["text"] == w.text
            assert w.logprobs is not None
            _assert_completion_logprobs(llm, c["logprobs"], w.token_ids, w.logprobs, 0)
            assert c["finish_reason"] == "length"
        usage = out["usage"]
        assert usage["completion_tokens"] == sum(len(w.token_ids) for w in want) == 80
        assert usage["prompt_tokens"] == sum(len(p) for p in prompts)  # once per prompt

        chat = await _post(
            http,
            "/v1/chat/completions",
            model=name,
            messages=MESSAGES,
            max_tokens=6,
            temperature=1.0,
            seed=3,
            n=2,
            logprobs=True,
            top_logprobs=1,
            ignore_eos=True,
        )
        assert [c["index"] for c in chat["choices"]] == [0, 1]
        for c, w in zip(chat["choices"], chat_want, strict=True):
            assert c["message"]["content"] == w.text
            assert w.logprobs is not None
            _assert_chat_logprobs(llm, c["logprobs"]["content"], w.logprobs, 1)
        assert chat["usage"]["completion_tokens"] == 12
        assert chat["usage"]["prompt_tokens"] == len(chat_ids)

    run(body)


def test_penalties_bias_min_tokens_stop_ids_equal_llm(run, llm: LLM, model_dir: Path) -> None:
    name = _name(model_dir)
    prompt = random_prompts(1, 500, min_len=12, max_len=12, seed=31)[0]
    [greedy] = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    stop_id = greedy.token_ids[3]
    assert len(greedy.text) >= 4
    stop_text = greedy.text[2:4]
    forced = 77
    cases: list[tuple[dict[str, object], SamplingParams]] = [
        ({"repetition_penalty": 1.3}, SamplingParams(repetition_penalty=1.3)),
        (
            {"presence_penalty": 1.5, "frequency_penalty": 0.7},
            SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
        ),
        (
            {"frequency_penalty": -1.0, "temperature": 0.8, "seed": 4},
            SamplingParams(frequency_penalty=-1.0, temperature=0.8, seed=4),
        ),
        ({"logit_bias": {str(forced): 100}}, SamplingParams(logit_bias={forced: 100.0})),
        ({"logit_bias": {str(stop_id): -100}}, SamplingParams(logit_bias={stop_id: -100.0})),
        ({"stop_token_ids": [stop_id]}, SamplingParams(stop_token_ids=(stop_id,))),
        (
            {"stop": [stop_text], "include_stop_str_in_output": True},
            SamplingParams(stop=(stop_text,), include_stop_str_in_output=True),
        ),
        (
            {"min_p": 0.2, "temperature": 1.5, "seed": 3},
            SamplingParams(min_p=0.2, temperature=1.5, seed=3),
        ),
        (
            {"stop_token_ids": [stop_id], "min_tokens": 6},
            SamplingParams(stop_token_ids=(stop_id,), min_tokens=6),
        ),
    ]
    wants = llm.generate(
        [prompt] * len(cases),
        [replace(sp, max_tokens=12, logprobs=0, ignore_eos=True) for _, sp in cases],
    )

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        for (fields, _), want in zip(cases, wants, strict=True):
            request = {
                "model": name,
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": 0,
                "ignore_eos": True,
                **fields,
            }
            choice = (await _post(http, "/v1/completions", **request))["choices"][0]
            assert choice["text"] == want.text, fields
            assert want.logprobs is not None
            _assert_completion_logprobs(llm, choice["logprobs"], want.token_ids, want.logprobs, 0)
            assert choice["finish_reason"] == want.finish_reason.value, fields
        by_name = {json.dumps(f): w for (f, _), w in zip(cases, wants, strict=True)}
        assert by_name[json.dumps({"logit_bias": {str(forced): 100}})].token_ids == [forced] * 12
        assert stop_id not in by_name[json.dumps({"logit_bias": {str(stop_id): -100}})].token_ids
        stopped = by_name[json.dumps({"stop_token_ids": [stop_id]})]
        assert stopped.token_ids == greedy.token_ids[:4] and stopped.finish_reason.value == "stop"
        kept = by_name[json.dumps({"stop": [stop_text], "include_stop_str_in_output": True})]
        assert kept.text.endswith(stop_text) and kept.finish_reason.value == "stop"
        late = by_name[json.dumps({"stop_token_ids": [stop_id], "min_tokens": 6})]
        assert len(late.token_ids) >= 6 and stop_id not in late.token_ids[:5]

    run(body)


def test_streaming_n2_indexes_and_one_usage_chunk(run, llm: LLM, model_dir: Path) -> None:
    name = _name(model_dir)
    common = {
        "model": name,
        "max_tokens": 7,
        "temperature": 1.0,
        "seed": 12,
        "n": 2,
        "ignore_eos": True,
    }

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        whole = await _post(http, "/v1/completions", prompt="Hello there", logprobs=1, **common)
        resp = await http.post(
            "/v1/completions",
            json={
                "prompt": "Hello there",
                "logprobs": 1,
                "stream": True,
                "stream_options": {"include_usage": True},
                **common,
            },
        )
        chunks = _sse(resp.content)
        usage = [c for c in chunks if "usage" in c]
        assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1]["choices"] == []
        assert usage[0]["usage"]["completion_tokens"] == 14 == whole["usage"]["completion_tokens"]
        assert usage[0]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        body_chunks = chunks[:-1]
        assert all(len(c["choices"]) == 1 for c in body_chunks)
        for i in (0, 1):
            mine = [c["choices"][0] for c in body_chunks if c["choices"][0]["index"] == i]
            assert [m["finish_reason"] for m in mine][-1] == "length"
            assert sum(m["finish_reason"] is not None for m in mine) == 1
            assert "".join(m["text"] for m in mine) == whole["choices"][i]["text"]
            tokens = [t for m in mine for t in m["logprobs"]["tokens"]]
            assert tokens == whole["choices"][i]["logprobs"]["tokens"]
            offsets = [t for m in mine for t in m["logprobs"]["text_offset"]]
            assert offsets == whole["choices"][i]["logprobs"]["text_offset"]

        # chat: each index's first chunk names the role; each chunk's logprobs are its delta's
        chat = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, **common}
        whole = await _post(http, "/v1/chat/completions", **chat)
        resp = await http.post("/v1/chat/completions", json={**chat, "stream": True})
        chunks = _sse(resp.content)
        for i in (0, 1):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
            assert mine[0]["delta"]["role"] == "assistant" and mine[0]["logprobs"] is None
            content = [e for m in mine[1:] for e in m["logprobs"]["content"]]
            _assert_same_entries(content, whole["choices"][i]["logprobs"]["content"])
            text = "".join(m["delta"].get("content", "") for m in mine)
            assert text == whole["choices"][i]["message"]["content"]

    run(body)


def test_disconnect_with_n_ends_every_completion(run, model_dir: Path) -> None:
    name = _name(model_dir)
    long = {"model": name, "prompt": "Hello", "max_tokens": 400, "n": 3, "ignore_eos": True}

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        node = cluster.decodes[0]
        # mid-stream: read a few chunks of the three completions, then go away
        async with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 6:
                    break
        await cluster.assert_idle_and_conserved()
        assert not node.streams
        # before the first byte: the whole-answer request cancelled while it generates
        task = asyncio.ensure_future(http.post("/v1/completions", json=long))
        while not node.streams:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await cluster.assert_idle_and_conserved()
        # the node still serves n > 1
        out = await _post(http, "/v1/completions", **{**long, "max_tokens": 2})
        assert len(out["choices"]) == 3

    run(body)


def test_sdk_parses_logprobs_and_raises_bad_request(run, model_dir: Path) -> None:
    name = _name(model_dir)

    async def body(cluster: PdCluster, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI) -> None:
        done = await sdk.completions.create(
            model=name,
            prompt="Hello",
            max_tokens=4,
            temperature=0,
            logprobs=3,
            n=2,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in done.choices] == [0, 1]
        lp = done.choices[0].logprobs
        assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 4
        assert len(lp.text_offset) == 4 and lp.top_logprobs is not None
        # greedy: the chosen token is the most likely one, first among the alternatives
        assert all(next(iter(top)) == t for top, t in zip(lp.top_logprobs, lp.tokens, strict=True))
        assert done.usage.completion_tokens == 8
        chat = await sdk.chat.completions.create(
            model=name,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == 3
        assert all(len(c.top_logprobs) == 2 and c.bytes is not None for c in content)
        assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
        stream = await sdk.chat.completions.create(
            model=name,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        streamed = [
            e
            for c in [c async for c in stream]
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert [e.token for e in streamed] == [e.token for e in content]

        base = {"model": name, "prompt": "x", "max_tokens": 3}
        chat_base = {"model": name, "messages": MESSAGES, "max_tokens": 3}
        bad: list[tuple[str, dict[str, object], str]] = [
            ("/v1/completions", {"logprobs": 21}, "logprobs"),
            ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
            ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
            ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
            ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
            ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
            ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
            ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
            ("/v1/completions", {"n": 0}, "n"),
            ("/v1/completions", {"n": 17}, "n"),
            ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
            ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
            ("/v1/completions", {"min_tokens": 4}, "min_tokens"),
            ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids.0"),
            ("/v1/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
            ("/v1/completions", {"suffix": "tail"}, "suffix"),
            ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ]
        for path, fields, param in bad:
            request = {**(chat_base if "chat" in path else base), **fields}
            resp = await http.post(path, json=request)
            assert resp.status_code == 400, (fields, resp.text)
            assert resp.json()["error"]["param"] == param, (fields, resp.json())
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            await sdk.completions.create(model=name, prompt="x", logprobs=21)
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            await sdk.completions.create(model=name, prompt="x", presence_penalty=9)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await sdk.chat.completions.create(
                model=name, messages=MESSAGES, logprobs=True, top_logprobs=30
            )

    run(body)
