"""The official `openai` package against a real `pdserve up` cluster (separate processes, 2
prefill nodes): completions and chat, streamed and not, usage only when asked, /v1/models, the
SDK's own exception classes; greedy HTTP == gRPC == the colocated LLM; chat prompts rendered
exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.client import generate
from pdserve.cluster import Cluster
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.chat_template import ChatTemplate
from shared.model.loader import load_model
from shared.serving.metrics import parse_prometheus_text
from tests.engine_helpers import CHATML, chat_checkpoint, random_prompts

KEY = "test-key-123"
SERVED = "pd-tiny"
# in tokenizer_config.json: ChatML
# given with --chat-template: Llama-2 style, with bos_token, eos_token and raise_exception
LLAMA2 = """{%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system = '' -%}{%- endif -%}
{{ bos_token }}{% if system %}<<SYS>>
{{ system }}
<</SYS>>

{% endif %}
{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
{%- endif -%}
{%- if message['role'] == 'user' -%}[INST] {{ message['content'] | trim }} [/INST]
{%- else %} {{ message['content'] | trim }} {{ eos_token }}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %} {% endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "  sat on\nthe mat "},
        {"role": "user", "content": "and then?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.checkpoints import cached_checkpoint

    src = cached_checkpoint(checkpoint_root, "llama")
    path = chat_checkpoint(src, tmp_path_factory.mktemp("chat") / "llama-chat")
    (path / "llama2.jinja").write_text(LLAMA2)
    return path


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    decode_args = ["--api-key", KEY, "--served-model-name", SERVED, "--max-inflight", "16"]
    decode_args += ["--max-queued", "0"]  # the 17th concurrent request is refused, not queued
    decode_args += ["--chat-template", str(model_dir / "llama2.jinja")]
    c = Cluster(str(model_dir), 2, 1, 0, [], http_port=0, decode_extra=decode_args)
    try:
        c.start(timeout=180, echo=False)
        yield c
    finally:
        assert c.stop() == 0, "a node exited non-zero (failed conservation at shutdown?)"


def _client(cluster: Cluster, key: str = KEY) -> openai.AsyncOpenAI:
    base = cluster.http_endpoints[0] + "/v1"
    return openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def _assert_released(cluster: Cluster) -> None:
    deadline = time.monotonic() + 15
    while True:
        busy = []
        for node in cluster.nodes:
            url = f"http://127.0.0.1:{node.info['metrics_port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                m = parse_prometheus_text(resp.read().decode())
            # live requests count against --max-inflight until the engine forgets them (a
            # max_tokens=1 reply can reach the client while its KV still lands)
            live = sum(v for k, v in m.items() if k.startswith("pdserve_requests{"))
            held = (m["pdserve_seats_in_use"], m["pdserve_kv_blocks_pinned"], live)
            if any(held):
                busy.append((node.role, *held))
        if not busy:
            return
        assert time.monotonic() < deadline, f"resources still held: {busy}"
        time.sleep(0.1)


def test_chat_templates_render_like_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = load_model(str(model_dir)).chat_template
    assert ours is not None and ours.source == CHATML
    override = ChatTemplate(LLAMA2, bos_token=ours.bos_token, eos_token=ours.eos_token)
    for template, mine in ((CHATML, ours), (LLAMA2, override)):
        for messages in CONVERSATIONS:
            for gen in (True, False):
                want = hf.apply_chat_template(
                    messages, chat_template=template, tokenize=False, add_generation_prompt=gen
                )
                assert mine.render(messages, add_generation_prompt=gen) == want


def test_completions_and_chat_through_the_sdk(cluster: Cluster) -> None:
    async def body() -> None:
        async with _client(cluster) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [SERVED]
            done = await client.completions.create(
                model=SERVED,
                prompt="Hello",
                max_tokens=5,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
            assert done.usage.completion_tokens == 5
            assert done.usage.total_tokens == done.usage.prompt_tokens + 5
            bare = await client.completions.create(
                model=SERVED, prompt="Hello", max_tokens=1, extra_body={"add_special_tokens": False}
            )
            assert bare.usage.prompt_tokens == done.usage.prompt_tokens - 1  # no BOS

            stream = await client.completions.create(
                model=SERVED,
                prompt="Hello",
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            assert all(c.usage is None for c in chunks)
            assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text

            chat = await client.chat.completions.create(
                model=SERVED, messages=CONVERSATIONS[1], max_tokens=6, temperature=0
            )
            assert chat.object == "chat.completion"
            assert chat.choices[0].message.role == "assistant"
            assert chat.choices[0].finish_reason in ("stop", "length")
            stream = await client.chat.completions.create(
                model=SERVED,
                messages=CONVERSATIONS[1],
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and usage.prompt_tokens == chat.usage.prompt_tokens
            assert usage.completion_tokens == chat.usage.completion_tokens
            # the same prompt again: its full blocks come from the prefix cache
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached > chat.usage.prompt_tokens_details.cached_tokens
            text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
            assert text == chat.choices[0].message.content

    asyncio.run(body())
    _assert_released(cluster)


def test_errors_are_the_sdks_exception_classes(cluster: Cluster) -> None:
    async def body() -> None:
        async with _client(cluster, key="wrong") as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with _client(cluster) as client:
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
            with pytest.raises(openai.BadRequestError, match="logprobs"):
                await client.completions.create(model=SERVED, prompt="x", logprobs=21)
            with pytest.raises(openai.BadRequestError, match="max_tokens"):
                await client.completions.create(model=SERVED, prompt="x", max_tokens=10**7)
            with pytest.raises(openai.BadRequestError, match="guided_json"):
                await client.completions.create(
                    model=SERVED, prompt="x", extra_body={"guided_json": {"type": "wat"}}
                )
            for field, value in [("skip_special_tokens", False), ("echo", True)]:
                with pytest.raises(openai.BadRequestError, match=field):
                    await client.chat.completions.create(
                        model=SERVED,
                        messages=[{"role": "user", "content": "hi"}],
                        extra_body={field: value},
                    )
            with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
                await client.chat.completions.create(
                    model=SERVED,
                    messages=[{"role": "user", "content": "hi"}],
                    extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
                )
            assert (await client.models.retrieve(SERVED)).id == SERVED
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("gpt-9")
            with pytest.raises(openai.BadRequestError, match="alternate"):
                await client.chat.completions.create(
                    model=SERVED, messages=[{"role": "assistant", "content": "first?"}]
                )
            # fill the node's 16 admission slots with long streams; the 17th is refused. Sent
            # at once: one after another, the first ones could end before the last is in
            opened = [
                client.completions.create(
                    model=SERVED,
                    prompt=[1, 2, 3],
                    max_tokens=1000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in range(16)
            ]
            streams = await asyncio.gather(*opened)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=SERVED, prompt="x", max_tokens=1)
            for s in streams:
                await s.close()  # disconnect: aborted on both nodes

    asyncio.run(body())
    _assert_released(cluster)


def test_greedy_http_equals_grpc_equals_llm(cluster: Cluster, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    prompts = random_prompts(16, 500, min_len=1, max_len=150, seed=71)
    max_tokens = [1 + (7 * i) % 20 for i in range(16)]
    llm = LLM(EngineConfig(model=str(model_dir), num_kv_blocks=512), load_model(str(model_dir)))
    want = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    hf = AutoTokenizer.from_pretrained(model_dir)
    rendered = [
        hf.apply_chat_template(m, chat_template=LLAMA2, tokenize=False, add_generation_prompt=True)
        for m in CONVERSATIONS
    ]
    chat_ids = [hf(r, add_special_tokens=False).input_ids for r in rendered]
    chat_want = llm.generate(chat_ids, [SamplingParams(max_tokens=12)] * len(chat_ids))
    target = f"127.0.0.1:{next(n for n in cluster.nodes if n.role == 'decode').info['port']}"

    async def body() -> None:
        async with _client(cluster) as client:
            http = await asyncio.gather(
                *(
                    client.completions.create(model=SERVED, prompt=p, max_tokens=m, temperature=0)
                    for p, m in zip(prompts, max_tokens, strict=True)
                )
            )
            await asyncio.to_thread(_assert_released, cluster)  # each batch fills the 16 slots
            pairs = list(zip(prompts, max_tokens, strict=True))
            grpc_results = await asyncio.gather(
                *(generate(target, p, max_tokens=m) for p, m in pairs)
            )
            await asyncio.to_thread(_assert_released, cluster)
            chats = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=SERVED, messages=m, max_tokens=12, temperature=0
                    )
                    for m in CONVERSATIONS
                )
            )
        for i, (h, g, w) in enumerate(zip(http, grpc_results, want, strict=True)):
            assert g.token_ids == w.token_ids, f"prompt {i}: gRPC differs from the LLM"
            assert h.choices[0].text == w.text == g.text, f"prompt {i}: HTTP differs"
            assert h.usage.completion_tokens == len(w.token_ids)
            assert h.usage.prompt_tokens == len(prompts[i])
            assert h.choices[0].finish_reason == g.finish_reason
        for c, ids, w in zip(chats, chat_ids, chat_want, strict=True):
            assert c.usage.prompt_tokens == len(ids)  # the same prompt, no specials added twice
            assert c.choices[0].message.content == w.text

    asyncio.run(body())
    _assert_released(cluster)
