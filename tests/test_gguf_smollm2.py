"""SmolLM2-135M-Instruct (the built-in `smollm2`, a Q4_1 GGUF) through pdserve vs transformers
loading the same file: greedy token-exact through `LLM` and through P/D with 2 prefill nodes,
prefill logits allclose in fp32.

The slow module of the GGUF tests: the model is loaded once per process (module fixtures), a
prefill budget of 64 tokens splits the longer prompts into chunks, and outputs are short.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.gguf_builtin import SMOLLM2_SPEC, smollm2_path
from shared.model.loader import LoadedModel, load_model
from tests.support.clusters import SMOLLM2_PD_CHUNK
from tests.support.shared_cluster import SharedCluster
from tests.support.smollm2 import hf_smollm2

MAX_TOKENS = 8
CHUNK = SMOLLM2_PD_CHUNK  # max_num_tokens: prompts longer than this prefill in several steps
_SHARED = (
    "You are a careful assistant. Answer in one short sentence, and never invent facts. "
    "The user asks about geography, history and science. "
)
_QUESTIONS = [
    "What is the capital of France?",
    "Name a large ocean.",
    "Who wrote Romeo and Juliet?",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
]
_RAW = [
    "Hello",
    "The quick brown fox",
    "1, 2, 3, 4,",
    "Paris is the capital of",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a " * 6,  # > one chunk
    "Café, naïve, 日本語 and 😀 in one line:",
]


def chat(content: str, loaded: LoadedModel) -> list[int]:
    assert loaded.chat_template is not None
    text = loaded.chat_template.render([{"role": "user", "content": content}])
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def prompts_for(loaded: LoadedModel) -> list[list[int]]:
    """>= 16 prompts: raw text, chat-formatted questions (sharing the template's system prefix),
    questions behind a long shared prefix (> one chunk), and one long repeated text."""
    raw = [loaded.tokenizer.encode(t) for t in _RAW]
    chats = [chat(q, loaded) for q in _QUESTIONS]
    shared = [chat(_SHARED * 2 + q, loaded) for q in _QUESTIONS[:4]]
    prompts = [*raw, *chats, *shared]
    assert len(prompts) >= 16
    assert sum(len(p) > CHUNK for p in prompts) >= 4
    return prompts


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # On a shared, oversubscribed machine two OpenMP threads spin-wait on each other and a
    # forward pass gets ~15x slower; one thread keeps this module's runtime predictable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(SMOLLM2_SPEC, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return prompts_for(loaded)


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation (stopping at eos, included) for every prompt."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = hf_smollm2().generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=0,
            )
        out.append(gen[0, len(prompt) :].tolist())
    return out


def test_config_from_metadata(loaded: LoadedModel) -> None:
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (49152, 100000.0, 8192)
    assert c.tie_word_embeddings
    im_end = loaded.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert loaded.eos_token_ids == frozenset(im_end) == {2}
    assert loaded.generation_defaults == {}


def test_greedy_matches_transformers_through_llm(
    loaded: LoadedModel, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    engine = EngineConfig(model=SMOLLM2_SPEC, max_num_tokens=CHUNK, num_kv_blocks=512)
    llm = LLM(engine, loaded)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == reference
    assert any(o.cached_tokens > 0 for o in outputs)  # the shared prefixes hit the cache
    llm.check_conservation()


def test_greedy_matches_transformers_through_pd(
    smollm2_pd: SharedCluster, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """On the shared SmolLM2 cluster: 2 prefill nodes, prefill chunked at CHUNK tokens."""
    c = smollm2_pd.cluster

    async def body() -> None:
        results = await asyncio.gather(
            *(generate(c.targets[0], p, max_tokens=MAX_TOKENS, timeout=300) for p in prompts)
        )
        assert [list(r.token_ids) for r in results] == reference
        await c.assert_idle_and_conserved()

    smollm2_pd.run(body())


def test_prefill_logits_allclose(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    for prompt in (prompts[0], max(prompts, key=len)):
        blocks = -(-len(prompt) // 16)
        pool = allocate_kv_pool(loaded.config.kv_layout(16, torch.float32), blocks, "cpu")
        batch = ForwardBatch.build([SeqEntry(prompt, 0, list(range(blocks)))], 16, "cpu")
        ours = loaded.model(batch, pool, all_logits=True)
        with torch.inference_mode():
            theirs = hf_smollm2()(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


def test_weights_equal_transformers_dequantization(loaded: LoadedModel) -> None:
    theirs = hf_smollm2().state_dict()
    for name, param in loaded.model.state_dict().items():
        if name in theirs:
            assert torch.equal(param, theirs[name]), name


def test_gguf_path_from_wheel() -> None:
    path = smollm2_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert isinstance(path, Path) and path.stat().st_size > 50_000_000


def test_export_hf_runs_in_transformers(
    loaded: LoadedModel,
    prompts: list[list[int]],
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.export_hf import export_loaded

    export_loaded(loaded, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for prompt, want in list(zip(prompts, reference, strict=True))[::4]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=0,
            )
        assert gen[0, len(prompt) :].tolist() == want
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    for text in (*_RAW, "<|im_start|>user\nhi<|im_end|>"):
        assert tokenizer(text).input_ids == loaded.tokenizer.encode(text)
    messages = [{"role": "user", "content": _QUESTIONS[0]}]
    assert loaded.chat_template is not None
    assert tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == loaded.chat_template.render(messages)
