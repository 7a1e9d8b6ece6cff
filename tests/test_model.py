"""Our paged model against transformers: prefill logits, chunked prefill, greedy decode."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from shared.cdiv import cdiv
from shared.kv.pool import allocate_kv_pool
from shared.model.config import RopeScaling
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.llama import rope_inv_freq
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import config_from_hf
from tests.support.checkpoints import load_hf_model

ATOL = 1e-4
VOCAB = 512

# (arch, build_checkpoint kwargs): every architecture plus the variants that change numerics.
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama3", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "mistral-window8": ("mistral", {"sliding_window": 8}),
    "qwen2-window8": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "llama-sharded-3-layers": ("llama", {"max_shard_size": "40KB", "num_hidden_layers": 3}),
}


class Pool:
    """A KV pool plus a shuffled free list, so block tables are never contiguous."""

    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int, seed: int = 0):
        layout = loaded.config.kv_layout(block_size, loaded.model.dtype)
        self.tensor = allocate_kv_pool(layout, num_blocks, "cpu")
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def blocks(self, num_tokens: int) -> list[int]:
        n = cdiv(num_tokens, self.block_size)
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_batched_prefill_matches_transformers(name: str, variant: Callable[[str], Path]) -> None:
    path = variant(name)
    loaded, hf = load_model(str(path)), load_hf_model(path)
    seqs = prompts([1, 7, 23, 40], seed=len(name))
    pool = Pool(loaded, block_size=4, num_blocks=64)
    entries = [SeqEntry(s, 0, pool.blocks(len(s))) for s in seqs]

    batch = ForwardBatch.build(entries, 4, "cpu")
    all_logits = loaded.model(batch, pool.tensor, all_logits=True)

    expected = torch.cat([hf_logits(hf, s) for s in seqs])
    assert all_logits.dtype == torch.float32
    assert all_logits.shape == (sum(map(len, seqs)), VOCAB)
    torch.testing.assert_close(all_logits, expected, atol=ATOL, rtol=0)
    # The default (last token per sequence) output is the same rows.
    last = loaded.model(ForwardBatch.build(entries, 4, "cpu"), pool.tensor)
    torch.testing.assert_close(last, expected[batch.last_token_index], atol=ATOL, rtol=0)


def test_sliding_window_is_exercised(variant: Callable[[str], Path]) -> None:
    # Same seed, same weights: only the window differs, so logits past it must differ.
    ids = prompts([20])[0]
    full = hf_logits(load_hf_model(variant("mistral")), ids)
    windowed = hf_logits(load_hf_model(variant("mistral-window8")), ids)
    torch.testing.assert_close(full[:8], windowed[:8])
    assert (full[8:] - windowed[8:]).abs().max() > 1e-3


def test_llama3_inv_freq_matches_transformers(variant: Callable[[str], Path]) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = variant("llama3-rope")
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    assert config.rope_scaling.rope_type == "llama3"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(path))
    computed = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(computed, expected)
    # ...and the scaling really changes some frequencies at this head_dim.
    assert not torch.equal(
        computed, rope_inv_freq(config.head_dim, config.rope_theta, RopeScaling())
    )


def run_chunks(
    loaded: LoadedModel, pool: Pool, ids: list[int], chunk_sizes: Sequence[int], table: list[int]
) -> torch.Tensor:
    """Compute `ids` in consecutive chunks through the pool; all-token logits concatenated."""
    out, done = [], 0
    for size in chunk_sizes:
        entry = SeqEntry(ids[done : done + size], done, table)
        batch = ForwardBatch.build([entry], pool.block_size, "cpu")
        out.append(loaded.model(batch, pool.tensor, all_logits=True))
        done += size
    assert done == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_matches_single_pass(
    block_size: int, variant: Callable[[str], Path]
) -> None:
    loaded = load_model(str(variant("qwen2")))
    ids = prompts([45], seed=3)[0]
    pool = Pool(loaded, block_size, num_blocks=64)
    single = run_chunks(loaded, pool, ids, [45], pool.blocks(45))
    # Chunk boundaries inside and on block edges, and a one-token chunk (a decode-shaped step).
    chunked = run_chunks(loaded, pool, ids, [10, 1, 16, 5, 13], pool.blocks(45))
    torch.testing.assert_close(chunked, single, atol=1e-5, rtol=0)


def test_prefix_hit_and_mixed_batch_match_transformers(variant: Callable[[str], Path]) -> None:
    """A sequence reusing another's cached blocks (num_computed > 0), batched with a chunk of a
    third sequence and a decode-shaped step, gives transformers' logits for its full prompt."""
    path = variant("mistral-window8")
    loaded, hf = load_model(str(path)), load_hf_model(path)
    block = 4
    pool = Pool(loaded, block, num_blocks=96)
    shared_prefix, tail_a, tail_b = prompts([16, 9, 11], seed=5)
    other = prompts([30], seed=6)[0]

    table_a = pool.blocks(25)
    first = ForwardBatch.build([SeqEntry(shared_prefix + tail_a, 0, table_a)], block, "cpu")
    loaded.model(first, pool.tensor)

    # B reuses A's four full prefix blocks; `other` has 20 tokens cached and computes 9 more
    # plus one more token in a separate entry shape.
    table_b = table_a[:4] + pool.blocks(11)
    table_o = pool.blocks(30)
    loaded.model(ForwardBatch.build([SeqEntry(other[:20], 0, table_o)], block, "cpu"), pool.tensor)
    entries = [
        SeqEntry(other[20:29], 20, table_o),
        SeqEntry(tail_b, 16, table_b),
    ]
    logits = loaded.model(ForwardBatch.build(entries, block, "cpu"), pool.tensor, all_logits=True)
    step = loaded.model(
        ForwardBatch.build([SeqEntry(other[29:], 29, table_o)], block, "cpu"), pool.tensor
    )

    torch.testing.assert_close(logits[:9], hf_logits(hf, other)[20:29], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        logits[9:], hf_logits(hf, shared_prefix + tail_b)[16:], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(step[0], hf_logits(hf, other)[29], atol=ATOL, rtol=0)


def test_attention_groups_split_on_skewed_lengths(variant: Callable[[str], Path]) -> None:
    """One long context among short ones splits into several padded groups (and the decode step
    mixes with prefill chunks); results equal each sequence computed alone."""
    loaded = load_model(str(variant("llama")))
    block = 4
    pool = Pool(loaded, block, num_blocks=200)
    seqs = prompts([300, 6, 9, 3, 12], seed=7)
    tables = [pool.blocks(len(s) + 1) for s in seqs]
    for s, t in zip(seqs, tables, strict=True):
        loaded.model(ForwardBatch.build([SeqEntry(s[:-2], 0, t)], block, "cpu"), pool.tensor)
    # Long decode + short decodes + short two-token chunks.
    entries = [
        SeqEntry(s[-2:] if i % 2 else s[-2:-1], len(s) - 2, t)
        for i, (s, t) in enumerate(zip(seqs, tables, strict=True))
    ]
    batch = ForwardBatch.build(entries, block, "cpu")
    assert len(batch.groups) >= 3
    together = loaded.model(batch, pool.tensor, all_logits=True)
    alone = torch.cat(
        [
            loaded.model(ForwardBatch.build([e], block, "cpu"), pool.tensor, all_logits=True)
            for e in entries
        ]
    )
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def greedy_decode(
    loaded: LoadedModel, prompt_ids: list[list[int]], max_new: int, block_size: int
) -> list[list[int]]:
    """Greedy generation for several prompts at once, driven directly through ForwardBatch."""
    pool = Pool(loaded, block_size, num_blocks=256, seed=block_size)
    tables = [pool.blocks(len(p) + max_new) for p in prompt_ids]
    seqs = [list(p) for p in prompt_ids]
    outputs: list[list[int]] = [[] for _ in prompt_ids]
    pending = [list(p) for p in prompt_ids]  # tokens not yet in the pool
    live = set(range(len(prompt_ids)))
    while live:
        order = sorted(live)
        entries = [SeqEntry(pending[i], len(seqs[i]) - len(pending[i]), tables[i]) for i in order]
        logits = loaded.model(ForwardBatch.build(entries, block_size, "cpu"), pool.tensor)
        for row, i in enumerate(order):
            token = int(logits[row].argmax())
            outputs[i].append(token)
            seqs[i].append(token)
            pending[i] = [token]
            if token in loaded.eos_token_ids or len(outputs[i]) == max_new:
                live.discard(i)
    return outputs


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_decode_matches_generate(
    name: str, block_size: int, variant: Callable[[str], Path]
) -> None:
    path = variant(name)
    loaded, hf = load_model(str(path)), load_hf_model(path)
    prompt_ids = prompts([5, 17, 33], seed=11)
    max_new = 12
    ours = greedy_decode(loaded, prompt_ids, max_new, block_size)
    assert all(len(set(o)) > 3 for o in ours), "degenerate checkpoint: decode parity is vacuous"
    for prompt, got in zip(prompt_ids, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new
            )
        assert got == out[0, len(prompt) :].tolist()


def test_layer_hook_fires_after_each_layers_write(variant: Callable[[str], Path]) -> None:
    loaded = load_model(str(variant("llama-sharded-3-layers")))
    pool = Pool(loaded, 4, num_blocks=16)
    ids = prompts([10])[0]
    batch = ForwardBatch.build([SeqEntry(ids, 0, pool.blocks(10))], 4, "cpu")
    slots = batch.slot_mapping
    seen: list[int] = []

    def hook(layer: int) -> None:
        planes = pool.tensor[layer].view(2, -1, *pool.tensor.shape[-2:])
        assert planes[:, slots].abs().sum() > 0, "layer's K/V not written yet"
        if layer + 1 < loaded.config.num_layers:
            later = pool.tensor[layer + 1].view(2, -1, *pool.tensor.shape[-2:])
            assert later[:, slots].abs().sum() == 0, "hook fired late"
        seen.append(layer)

    loaded.model(batch, pool.tensor, layer_hook=hook)
    assert seen == [0, 1, 2]


def test_forward_batch_indices() -> None:
    entries = [
        SeqEntry([7, 8, 9], 2, [5, 1]),  # positions 2..4 -> blocks 5 (pos 2,3) and 1 (pos 4)
        SeqEntry([3], 9, [0, 2, 4, 6]),  # decode at position 9 -> block 4, offset 1
    ]
    batch = ForwardBatch.build(entries, 4, "cpu")
    assert batch.input_ids.tolist() == [7, 8, 9, 3]
    assert batch.positions.tolist() == [2, 3, 4, 9]
    assert batch.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0, 4 * 4 + 1]
    assert batch.last_token_index.tolist() == [2, 3]
    assert batch.context_lens == [5, 10]
    assert sorted(i for g in batch.groups for i in g.seq_ids) == [0, 1]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (SeqEntry([], 0, [0]), "no new tokens"),
        (SeqEntry([1, 2, 3, 4, 5], 0, [0]), "need 2"),
        (SeqEntry([1], -1, [0]), "num_computed"),
    ],
)
def test_forward_batch_rejects_bad_entries(entry: SeqEntry, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build([entry], 4, "cpu")


def test_pool_shape_must_match_model() -> None:
    loaded = load_model("tiny")
    wrong = torch.zeros(loaded.config.num_layers, 2, 4, 4, 1, loaded.config.head_dim)
    batch = ForwardBatch.build([SeqEntry([1, 2], 0, [0])], 4, "cpu")
    with pytest.raises(ValueError, match="kv_heads"):
        loaded.model(batch, wrong)


def test_bf16_weights_give_fp32_logits_close_to_fp32() -> None:
    fp32, bf16 = load_model("tiny"), load_model("tiny", dtype=torch.bfloat16)
    assert bf16.model.dtype == torch.bfloat16
    ids = prompts([20])[0]
    results = []
    for loaded in (fp32, bf16):
        pool = Pool(loaded, 16, num_blocks=4)
        batch = ForwardBatch.build(
            [SeqEntry([i % 256 for i in ids], 0, pool.blocks(20))], 16, "cpu"
        )
        results.append(loaded.model(batch, pool.tensor))
    assert results[1].dtype == torch.float32
    torch.testing.assert_close(results[1], results[0], atol=0.05, rtol=0)


def test_batch_of_one_token_prompts(variant: Callable[[str], Path]) -> None:
    # A whole batch of fresh one-token sequences takes the no-scatter fast path.
    path = variant("llama")
    loaded, hf = load_model(str(path)), load_hf_model(path)
    pool = Pool(loaded, 4, num_blocks=8)
    entries = [SeqEntry([t], 0, pool.blocks(1)) for t in (5, 77, 300)]
    logits = loaded.model(ForwardBatch.build(entries, 4, "cpu"), pool.tensor)
    expected = torch.cat([hf_logits(hf, [t]) for t in (5, 77, 300)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
