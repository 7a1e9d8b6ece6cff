"""Structured outputs (response_format, vLLM's structured_outputs / guided_*) on real nodes: a
P/D cluster with 2 prefill nodes (the first token drawn under the grammar there) and a colocated
node, over HTTP and gRPC, on `tiny` (byte tokenizer), a byte-level BPE checkpoint and SmolLM2.
Every output that finishes with `stop` validates; seeded outputs are identical P/D and
colocated; after success, errors and cancels every seat, block and grammar matcher is back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.sampling.grammar_compiler import compiler_for
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.sampling.structured_output import StructuredOutput
from tests.engine_helpers import chat_checkpoint
from tests.structured_corpus import SCHEMAS
from tests.support.cluster import PdCluster, pd_cluster
from tests.support.shared_cluster import SharedCluster

ENGINE = EngineConfig(model="tiny", num_kv_blocks=512, max_batch_size=16)


@pytest.fixture(params=["xgrammar", "llguidance"])
def grammar_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The grammar library the node compiles with: llguidance is a default install's,
    xgrammar the `structured` extra's."""
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")
    monkeypatch.setenv("PDSERVE_GRAMMAR_BACKEND", request.param)
    return request.param


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 170))


@contextlib.asynccontextmanager
async def both(model: str | Path, engine: EngineConfig) -> AsyncIterator[list[PdCluster]]:
    """A P/D cluster (2 prefill nodes) and a colocated node, each with its HTTP API."""
    http = {"http_port": 0}
    async with (
        pd_cluster(
            model, num_prefill=2, prefill_engine=engine, decode_engine=engine, decode_overrides=http
        ) as pd,
        pd_cluster(model, colocated=True, prefill_engine=engine, decode_overrides=http) as co,
    ):
        yield [pd, co]
        for c in (pd, co):
            await c.assert_idle_and_conserved()


def url(c: PdCluster) -> str:
    return f"http://127.0.0.1:{c.decodes[0].http_port}"


async def post(c: PdCluster, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(url(c) + path, json={"model": model_name(c), **body})


def model_name(c: PdCluster) -> str:
    return c.decodes[0].core.loaded.name


def fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


def check(schema: dict[str, Any], choice: dict[str, Any]) -> bool:
    """A stopped output validates; returns whether it stopped."""
    text = choice.get("text", choice.get("message", {}).get("content"))
    if choice["finish_reason"] != "stop":
        return False
    jsonschema.validate(json.loads(text), schema)
    return True


async def corpus_answers(c: PdCluster, reqs: list[dict[str, Any]]) -> list[str]:
    """Each request's text, all sent at once: every one a 200, every one that stops valid
    under its schema, at least half of them stopped."""
    answers = await asyncio.gather(*(post(c, "/v1/completions", r) for r in reqs))
    stopped = 0
    for r, a in zip(reqs, answers, strict=True):
        assert a.status_code == 200, a.text
        schema = r["response_format"]["json_schema"]["schema"]
        stopped += check(schema, a.json()["choices"][0])
    assert stopped >= len(reqs) // 2, f"only {stopped} of {len(reqs)} stopped"
    return [a.json()["choices"][0]["text"] for a in answers]


def test_schema_corpus_pd_and_colocated(grammar_backend: str) -> None:
    async def body() -> None:
        async with both("tiny", ENGINE) as clusters:
            texts = []
            for c in clusters:
                reqs = [
                    {"prompt": f"p{i}", "max_tokens": 48, "response_format": fmt(s), **mode}
                    for i, s in enumerate(SCHEMAS)
                    for mode in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7 + i})
                ]
                texts.append(await corpus_answers(c, reqs))
                # max_tokens 1: the prefill node's token alone is a valid start
                ones = await asyncio.gather(
                    *(
                        post(c, "/v1/completions", {**r, "max_tokens": 1, "logprobs": 2})
                        for r in reqs
                    )
                )
                compiler = compiler_for(c.decodes[0].core.tokenizer, 259)
                for r, a in zip(reqs, ones, strict=True):
                    spec = StructuredOutput(
                        "json_schema", json.dumps(r["response_format"]["json_schema"]["schema"])
                    )
                    token = a.json()["choices"][0]["text"].encode()
                    assert len(token) == 1 and compiler.allows(spec, list(token)), a.text
            assert texts[0] == texts[1], "P/D and colocated disagree"

    run(body())


def test_choice_regex_grammar_and_combinations(grammar_backend: str) -> None:
    regex = r"[a-z]{2,4}-\d{2}"
    cases: list[tuple[dict[str, Any], Callable[[str], bool]]] = [
        (
            {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
            lambda t: t in {"alpha", "beta", "gamma"},
        ),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in {"yes", "no"}),
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t) is not None),
        ({"guided_regex": r"\d{1,3}"}, lambda t: re.fullmatch(r"\d{1,3}", t) is not None),
        ({"guided_grammar": 'root ::= "a" ("b" | "c") "d"'}, lambda t: t in {"abd", "acd"}),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ]

    async def body() -> None:
        async with both("tiny", ENGINE) as clusters:
            for c in clusters:
                for extra, ok in cases:
                    for seed in range(3):
                        r = {
                            "prompt": "q",
                            "max_tokens": 64,
                            "temperature": 1.0,
                            "seed": seed,
                            "n": 2,
                            "logprobs": 1,
                            "presence_penalty": 0.5,
                            **extra,
                        }
                        a = await post(c, "/v1/completions", r)
                        assert a.status_code == 200, a.text
                        for ch in a.json()["choices"]:
                            assert ch["finish_reason"] == "stop" or "json_object" in str(extra)
                            if ch["finish_reason"] == "stop":
                                assert ok(ch["text"]), (extra, ch["text"])
                await streamed_and_cancelled(c)

    run(body())


async def streamed_and_cancelled(c: PdCluster) -> None:
    """Streaming n=2 chat-less completions validate; a stream closed early releases all."""
    schema = SCHEMAS[3]
    r = {
        "prompt": "s",
        "max_tokens": 48,
        "stream": True,
        "n": 2,
        "seed": 3,
        "temperature": 0.8,
        "response_format": fmt(schema),
    }
    texts = {0: "", 1: ""}
    finish = {}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", url(c) + "/v1/completions", json={"model": model_name(c), **r}
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    texts[ch["index"]] += ch["text"]
                    if ch.get("finish_reason"):
                        finish[ch["index"]] = ch["finish_reason"]
        for i in (0, 1):
            check(schema, {"text": texts[i], "finish_reason": finish[i]})
        long = {**r, "max_tokens": 200, "response_format": fmt({"type": "string"})}
        async with client.stream(
            "POST", url(c) + "/v1/completions", json={"model": model_name(c), **long}
        ) as resp:
            async for _ in resp.aiter_lines():
                break  # the client goes away: the request is cancelled on both nodes
    await c.assert_idle_and_conserved()


def test_bad_input_is_400_naming_the_field(grammar_backend: str) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"response_format": fmt({"type": "wat"})}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ]
    if grammar_backend == "llguidance":  # a schema keyword it cannot enforce: named, not ignored
        unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
        bad.append(({"response_format": fmt(unique)}, "response_format"))

    async def body() -> None:
        async with pd_cluster("tiny", num_prefill=1, decode_overrides={"http_port": 0}) as c:
            for extra, param in bad:
                a = await post(c, "/v1/completions", {"prompt": "x", "max_tokens": 4, **extra})
                assert a.status_code == 400, (extra, a.text)
                assert a.json()["error"]["param"] == param, a.text
                if "uniqueItems" in str(extra):
                    assert "uniqueItems" in a.json()["error"]["message"], a.text
            # gRPC: the same spec is INVALID_ARGUMENT before anything is queued
            params = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "(ab"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(c.targets[0], "x", params)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            ok = SamplingParams(max_tokens=40, structured=StructuredOutput("regex", r"\d{2}x"))
            result = await generate(c.targets[0], "x", ok)
            assert re.fullmatch(r"\d{2}x", result.text), result.text
            await c.assert_idle_and_conserved()

    run(body())


def test_first_token_the_grammar_rejects_is_refused(grammar_backend: str) -> None:
    from decode_node.grammar_check import check_first_tokens
    from shared.engine.core import EngineCore
    from shared.engine.roles.decode_role import DecodeSettings
    from shared.serving.grpc_server import GenerateError

    core = EngineCore(ENGINE, role=DecodeSettings())
    params = SamplingParams(structured=StructuredOutput("choice", '["yes"]'))
    check_first_tokens(core.info, [], params, (ord("y"), None, None, [], 0))
    with pytest.raises(GenerateError, match="not allowed"):
        check_first_tokens(core.info, [], params, (ord("n"), None, None, [], 0))
    with pytest.raises(GenerateError, match="not allowed"):  # another completion's, n > 1
        check_first_tokens(core.info, [], params, (ord("y"), None, None, [(ord("x"), None)], 0))


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


def test_openai_sdk_parse_with_pydantic(
    checkpoint: Callable[..., Path], tmp_path: Path, grammar_backend: str
) -> None:
    model = chat_checkpoint(checkpoint("llama"), tmp_path / "chat")

    async def body() -> None:
        engine = EngineConfig(model=str(model), num_kv_blocks=512, max_batch_size=16)
        async with both(model, engine) as clusters:
            for c in clusters:
                client = openai.AsyncOpenAI(base_url=url(c) + "/v1", api_key="x")
                done = await client.beta.chat.completions.parse(
                    model=model_name(c),
                    messages=[{"role": "user", "content": "a pet"}],
                    response_format=Pet,
                    max_tokens=60,
                    temperature=0.0,
                )
                pet = done.choices[0].message.parsed
                assert isinstance(pet, Pet), done
                await client.close()

    run(body())


def test_smollm2_schema_corpus_pd_matches_colocated(
    smollm2_pd: SharedCluster, smollm2_colocated: SharedCluster, grammar_backend: str
) -> None:
    """The real model on every schema of the corpus, greedy and seeded-sampled: every output
    that stops validates, and P/D (the shared SmolLM2 cluster: 2 prefill nodes) answers exactly
    what colocated (the shared colocated node, prefilling in steps of the same size) answers."""

    async def body() -> None:
        clusters = [smollm2_pd.cluster, smollm2_colocated.cluster]
        outs = []
        for c in clusters:
            reqs = [
                {
                    "prompt": "Answer in JSON:",
                    "max_tokens": 40,
                    "response_format": fmt(s),
                    **mode,
                }
                for i, s in enumerate(SCHEMAS)
                for mode in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 11 + i})
            ]
            outs.append(await corpus_answers(c, reqs))
            # max_tokens 1: the one token (through P/D, the prefill node's) starts the schema
            firsts = await asyncio.gather(
                *(post(c, "/v1/completions", {**r, "max_tokens": 1}) for r in reqs[::2])
            )
            tokenizer = c.decodes[0].core.info.tokenizer
            compiler = compiler_for(tokenizer, c.decodes[0].core.info.vocab_size)
            for r, a in zip(reqs[::2], firsts, strict=True):
                text = a.json()["choices"][0]["text"]
                spec = StructuredOutput(
                    "json_schema", json.dumps(r["response_format"]["json_schema"]["schema"])
                )
                ids = tokenizer.encode(text, add_special_tokens=False)
                assert ids and compiler.allows(spec, ids), (text, ids)
        assert outs[0] == outs[1], "P/D and colocated disagree"
        for c in clusters:
            await c.assert_idle_and_conserved()

    smollm2_pd.run(asyncio.wait_for(body(), 170))


def test_preempted_requests_resume_their_grammar(grammar_backend: str) -> None:
    """A pool too small for 8 requests at once: some are preempted and recomputed, their
    matchers rebuilt from their output tokens; every output equals the request's alone."""
    from shared.engine.llm import LLM

    regex = r"[a-z]{70,90}"
    params = [
        SamplingParams(
            max_tokens=100,
            temperature=0.9,
            seed=50 + i,
            structured=StructuredOutput("regex", regex),
        )
        for i in range(8)
    ]
    prompts = [[65 + i] * (10 + 3 * i) for i in range(8)]
    alone = LLM(EngineConfig(model="tiny", num_kv_blocks=1024)).generate(prompts, params)
    small = LLM(EngineConfig(model="tiny", num_kv_blocks=16, block_size=16, max_batch_size=8))
    got = small.generate(prompts, params)
    assert sum(o.num_preemptions for o in got) > 0, "nothing was preempted"
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    for o in got:
        assert o.finish_reason.value == "stop" and re.fullmatch(regex, o.text), o.text
    small.check_conservation()


def test_a_continued_answer_resumes_its_grammar(grammar_backend: str) -> None:
    """A structured answer cut at any point and continued (as a stream resumed on another node
    is: the tokens sent follow the prompt) goes on under the same grammar, exactly: the
    continuation's tokens are the rest of the whole answer's, seeded and greedy, and its first
    token passes the decode node's check."""
    from decode_node.grammar_check import check_first_tokens
    from shared.engine.llm import LLM

    llm = LLM(ENGINE)
    schema = StructuredOutput("json_schema", json.dumps(Pet.model_json_schema()))
    prompt = [65, 66, 67, 68]
    for params in (
        SamplingParams(max_tokens=60, structured=schema),
        SamplingParams(max_tokens=60, temperature=0.9, seed=3, structured=schema),
    ):
        (whole,) = llm.generate([prompt], [params])
        assert whole.finish_reason.value == "stop", whole.text
        json.loads(whole.text)
        for cut in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
            more, rest = params.continued(prompt, whole.token_ids[:cut])
            (tail,) = llm.generate([more], [rest])
            assert tail.token_ids == whole.token_ids[cut:], (cut, whole.text, tail.text)
            check_first_tokens(llm.core.info, more, rest, (tail.token_ids[0], None, None, [], 0))
    llm.check_conservation()


def test_across_the_split_a_continued_structured_answer_goes_on_exactly() -> None:
    """P/D: the prefill node draws the continuation's first token under the grammar after the
    tokens sent (SamplingParams.continued_tokens travels on the wire), the decode node's check
    passes it, and the answer goes on as it would have."""
    from tests.sampling_reference import pd_generate

    schema = StructuredOutput("json_schema", json.dumps(Pet.model_json_schema()))
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=4, structured=schema)
    prompt = [70, 71, 72]

    async def body() -> None:
        async with pd_cluster("tiny", prefill_engine=ENGINE, decode_engine=ENGINE) as c:
            (whole,) = await pd_generate(c.targets[0], prompt, params)
            cut = len(whole.token_ids) // 2
            more, rest = params.continued(prompt, whole.token_ids[:cut])
            (tail,) = await pd_generate(c.targets[0], more, rest)
            assert tail.token_ids == whole.token_ids[cut:]
            await c.assert_idle_and_conserved()

    run(body())


def test_wire_round_trip_and_unknown_kind() -> None:
    from proto.pdserve.v1 import generation_pb2
    from shared.serving.wire import (
        WireError,
        check_sampling,
        sampling_from_proto,
        sampling_to_proto,
    )

    for kind in ("json_schema", "json_object", "regex", "choice", "grammar"):
        params = SamplingParams(
            structured=StructuredOutput(kind, "" if kind == "json_object" else "x")
        )
        assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(generation_pb2.SamplingParams(max_tokens=1)).structured is None
    msg = generation_pb2.SamplingParams(max_tokens=1)
    msg.structured.kind = 77  # a kind from a newer client
    with pytest.raises(WireError, match=r"structured\.kind") as e:
        check_sampling(sampling_from_proto(msg), 259)
    assert e.value.field == "sampling.structured.kind"


def test_compiled_grammars_are_a_byte_bounded_lru_and_slow_compiles_time_out(
    grammar_backend: str,
) -> None:
    from shared.engine.sampling.grammar_compiler import GrammarCompiler, GrammarError, compile_async
    from shared.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    specs = [StructuredOutput("regex", f"a{{{i}}}") for i in range(1, 4)]
    sizes = [GrammarCompiler(tok, 259).get(s).memory_size_bytes for s in specs]
    compiler = GrammarCompiler(tok, 259, cache_bytes=sizes[0] + sizes[2] + 1)
    first = compiler.get(specs[0])
    compiler.get(specs[1])
    assert compiler.get(specs[0]) is first  # a hit, now the most recent
    compiler.get(specs[2])  # evicts specs[1], the least recent: the two others fit
    assert len(compiler) == 2 and compiler.get(specs[0]) is first
    assert compiler.cache.held_bytes == sizes[0] + sizes[2] <= compiler.cache.budget_bytes
    slow = StructuredOutput("json_schema", json.dumps(SCHEMAS[10]))
    with pytest.raises(GrammarError, match="did not compile within"):
        asyncio.run(compile_async(ByteTokenizer(), 259, slow, timeout=1e-9))


def test_without_xgrammar_structured_outputs_use_llguidance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """xgrammar is the optional `structured` extra: without it (a default install) the node
    compiles with llguidance, a default dependency; forcing xgrammar then is a 400 naming the
    package to install."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    monkeypatch.delenv("PDSERVE_GRAMMAR_BACKEND", raising=False)

    async def body() -> None:
        async with pd_cluster("tiny", num_prefill=1, decode_overrides={"http_port": 0}) as c:
            fmt_ = {"type": "json_object"}
            req = {"prompt": "x", "max_tokens": 64, "temperature": 0.0, "response_format": fmt_}
            a = await post(c, "/v1/completions", req)
            assert a.status_code == 200, a.text
            choice = a.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                assert isinstance(json.loads(choice["text"]), dict), a.text
            else:  # cut at max_tokens: still the start of an object
                assert choice["text"].startswith("{"), a.text
            monkeypatch.setenv("PDSERVE_GRAMMAR_BACKEND", "xgrammar")
            a = await post(c, "/v1/completions", {**req, "response_format": fmt({"type": "x"})})
            assert a.status_code == 400, a.text
            assert a.json()["error"]["param"] == "response_format", a.text
            assert "pip install 'pdserve[structured]'" in a.json()["error"]["message"], a.text
            plain = await post(c, "/v1/completions", {"prompt": "x", "max_tokens": 4})
            assert plain.status_code == 200, plain.text
            await c.assert_idle_and_conserved()

    run(body())


def test_a_grammar_past_its_limits_ends_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An object of 3,000 optional properties: llguidance's parser outgrows its row limit once
    the answer opens the object, so the matcher refuses the token its own mask allowed. That
    request ends with a 400 (HTTP) or INVALID_ARGUMENT (gRPC) naming the limit, whether its
    first token was drawn on the decode node (a short prompt) or on a prefill node (a long
    one); requests beside it finish, the node keeps serving, every seat and block is back."""
    monkeypatch.setenv("PDSERVE_GRAMMAR_BACKEND", "llguidance")
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    regex = r"[a-z]{20}"
    long_prompt = "y" * 300  # past local_prefill_tokens: prefilled on the prefill node
    decode = {"http_port": 0, "local_prefill_tokens": 256, "local_prefill_idle_tokens": 256}

    async def body() -> None:
        async with pd_cluster("tiny", num_prefill=1, decode_overrides=decode) as c:
            for prompt in ("y", long_prompt):
                calm = {"prompt": "x", "max_tokens": 30, "structured_outputs": {"regex": regex}}
                bad = {"prompt": prompt, "max_tokens": 8, "response_format": fmt(huge)}
                answers = await asyncio.gather(
                    post(c, "/v1/completions", calm),
                    post(c, "/v1/completions", bad),
                    post(c, "/v1/completions", calm | {"prompt": "z"}),
                )
                assert answers[1].status_code == 400, answers[1].text
                message = answers[1].json()["error"]["message"]
                assert "structured output: the grammar cannot go on" in message, message
                assert "max is 10000" in message, message
                for a in (answers[0], answers[2]):
                    assert a.status_code == 200, a.text
                    assert re.fullmatch(regex, a.json()["choices"][0]["text"]), a.text
                params = SamplingParams(
                    max_tokens=8, structured=StructuredOutput("json_schema", json.dumps(huge))
                )
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await generate(c.targets[0], prompt, params)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
                assert "cannot go on after 0 output tokens" in str(e.value.details())
            registry = c.prefills[0].metrics.registry
            refused = registry.get_sample_value(
                "pdserve_requests_total", {"outcome": "invalid_argument"}
            )
            local = c.decodes[0].metrics.registry.get_sample_value(
                "pdserve_prefills_total", {"where": "local"}
            )
            assert refused == 2, "the long prompts' first tokens were not drawn on the prefill node"
            assert local, "no prompt was prefilled on the decode node"
            again = await post(c, "/v1/completions", calm)
            assert again.status_code == 200, again.text
            await c.assert_idle_and_conserved()

    run(body())


def test_a_failed_grammar_leaves_the_engine_batch_going(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline engine: the failing request reports why; its neighbours' tokens are exactly
    what they are alone."""
    from shared.engine.llm import LLM

    monkeypatch.setenv("PDSERVE_GRAMMAR_BACKEND", "llguidance")
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    calm = SamplingParams(max_tokens=12, structured=StructuredOutput("regex", r"[a-z]{12}"))
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("json_schema", json.dumps(huge)))
    llm = LLM(ENGINE)
    alone = llm.generate([[70, 71]], calm)[0]
    got = llm.generate([[70, 71], [72], [70, 71]], [calm, bad, calm])
    assert got[1].finish_reason.value == "aborted" and got[1].token_ids == []
    assert got[1].error is not None and "Current row has" in got[1].error, got[1].error
    assert [got[0].token_ids, got[2].token_ids] == [alone.token_ids] * 2
    llm.core.check_conservation()
