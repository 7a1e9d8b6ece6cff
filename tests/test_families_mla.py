"""DeepSeek-V2 and V3 (multi-head latent attention, experts) against transformers: prefill
logits, greedy generation through `LLM`, P/D with two prefill nodes pushing latents, decode in
latent space against the expanded computation, the latent pool's size, yarn rope and the V2
router alone.

Tiny random checkpoints built with transformers (tests/support/checkpoints.py): q LoRA on
and off, grouped sigmoid routing (V3) and greedy / group-limited softmax routing (V2), shared
experts, a dense first layer, interleaved and half-split rope pairs, yarn with mscale_all_dim.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.client import generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from shared.model.mla import LatentAttention
from shared.model.registry import config_from_hf
from tests.engine_helpers import hf_greedy, random_max_tokens, random_prompts, single_torch_thread
from tests.sampling_reference import pd_generate
from tests.support.checkpoints import load_hf_model
from tests.support.cluster import pd_cluster
from tests.test_families_moe import nearest_router_tie
from tests.test_families_parity import (
    VOCAB,
    engine_config,
    family_prompts,
    greedy_matches_transformers,
)
from tests.test_families_parity import (
    test_prefill_logits_match_transformers as prefill_logits_match,
)
from tests.test_sampling_seeded import assert_same, by_request, mixed_params

_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 16.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "v3-8x3-grouped-qlora-dense-first": (
        "deepseek_v3",
        _MLA
        | {
            "q_lora_rank": 48,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    ),
    "v3-16x4-half-rope-unnormed-bias": (
        "deepseek_v3",
        _MLA
        | {
            "q_lora_rank": 24,
            "n_routed_experts": 16,
            "n_group": 8,
            "topk_group": 3,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 0,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "rope_interleave": False,
            "attention_bias": True,
            "v_head_dim": 24,
        },
    ),
    "v2-lite-greedy-yarn-bias": (
        "deepseek_v2",
        _MLA
        | {
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.5,
            "rope_parameters": YARN,
            "attention_bias": True,  # on kv_a_proj_with_mqa and o_proj, never on q_proj
        },
    ),
    "v2-group-limited-qlora": (
        "deepseek_v2",
        _MLA
        | {
            "num_hidden_layers": 3,
            "q_lora_rank": 40,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "topk_method": "group_limited_greedy",
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
        },
    ),
}
PD_VARIANT = "v3-8x3-grouped-qlora-dense-first"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mla_prefill_logits_match_transformers(name: str, variant: Callable[[str], Path]) -> None:
    prefill_logits_match(name, variant)


def deepseek_tie(
    _hf: torch.nn.Module, module: torch.nn.Module, out: tuple[torch.Tensor, ...]
) -> tuple[float, str]:
    """The scores (V3: sigmoid + correction, V2: softmax) of the last chosen and the best
    unchosen expert at the nearest tie."""
    logits, _, chosen = out
    scores = (
        logits.float().softmax(-1)
        if module.__class__.__name__.startswith("DeepseekV2")
        else logits.float().sigmoid() + module.e_score_correction_bias
    )
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    last = scores.masked_fill(~picked, float("inf")).min(dim=-1)
    rival = scores.masked_fill(picked, float("-inf")).max(dim=-1)
    gaps = last.values - rival.values
    t = int(gaps.argmin())
    return float(gaps[t]), (
        f"token {t}: expert {int(last.indices[t])} "
        f"{float(last.values[t]):.8f} vs expert {int(rival.indices[t])} "
        f"{float(rival.values[t]):.8f}"
    )


def closest_router_tie(path: Path, ids: list[int]) -> str:
    return nearest_router_tie(path, ids, deepseek_tie)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mla_greedy_generation_matches_transformers(
    name: str, variant: Callable[[str], Path]
) -> None:
    """14 prompts, chunked prefill (some span several chunks), prefix-cache hits, decode in
    latent space: every greedy token equals transformers' `generate`."""
    greedy_matches_transformers(variant(name), name, closest_router_tie)


def latent_bytes_per_token(path: Path, itemsize: int) -> int:
    """layers x (kv_lora_rank + qk_rope_head_dim) x itemsize, from the checkpoint's config."""
    hf = load_hf_model(path).config
    return hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * itemsize


def test_mla_pd_pushes_latents_and_matches_transformers(variant: Callable[[str], Path]) -> None:
    """Two prefill nodes over gRPC push latents layer by layer to a decode node: greedy tokens
    equal transformers', seeded sampling (logprobs, n > 1, penalties, stops) equals the
    colocated engine's, the bytes pushed per prompt token are one latent row per layer, and
    every seat and block is back after a deadline and a cancelled stream."""
    path = variant(PD_VARIANT)
    prompts = random_prompts(8, VOCAB, min_len=1, max_len=120, seed=11)
    max_tokens = random_max_tokens(8, hi=12, seed=12)
    prefill = EngineConfig(model=str(path), num_kv_blocks=512, max_num_tokens=48)
    block = prefill.block_size
    measured = random_prompts(1, VOCAB, min_len=4 * block, max_len=4 * block, seed=13)[0]
    sampled = mixed_params(8, seed=31)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=512), load_model(str(path)))
    colocated = by_request(llm.generate(prompts, sampled))

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2, prefill_engine=prefill) as c:
            results = await asyncio.gather(
                *(
                    generate(c.targets[0], p, max_tokens=m, timeout=120)
                    for p, m in zip(prompts, max_tokens, strict=True)
                )
            )
            for p, m, r in zip(prompts, max_tokens, results, strict=True):
                assert r.token_ids == hf_greedy(path, p, m), f"prompt of {len(p)} tokens"
            assert all(node.core.num_steps > 0 for node in c.prefills)  # both took prompts
            got = await asyncio.gather(
                *(pd_generate(c.targets[0], p, s) for p, s in zip(prompts, sampled, strict=True))
            )
            for g, w in zip(got, colocated, strict=True):
                assert len(g) == len(w)
                for a, b in zip(g, w, strict=True):
                    assert_same(a, b)
            before = (await asyncio.to_thread(c.metrics))[-1]["pdserve_kv_transfer_bytes_total"]
            r = await generate(c.targets[0], measured, max_tokens=2, timeout=120)
            assert r.token_ids == hf_greedy(path, measured, 2)
            after = (await asyncio.to_thread(c.metrics))[-1]["pdserve_kv_transfer_bytes_total"]
            per_token = (after - before) / len(measured)
            assert per_token == latent_bytes_per_token(path, itemsize=4)
            assert c.decodes[0].core.layout.token_bytes == per_token
            # a request past its deadline and one whose client goes away mid-stream
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await generate(c.targets[0], measured, max_tokens=200, timeout=0.05)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gone = asyncio.create_task(generate(c.targets[0], prompts[0], max_tokens=200))
            await asyncio.sleep(0.3)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def _set_absorb(model: torch.nn.Module, absorb: bool) -> None:
    layers = [m for m in model.modules() if isinstance(m, LatentAttention)]
    assert layers
    for layer in layers:
        layer.absorb = absorb


@pytest.mark.parametrize("name", ["v3-16x4-half-rope-unnormed-bias", "v2-lite-greedy-yarn-bias"])
def test_latent_decode_equals_expanded(name: str, variant: Callable[[str], Path]) -> None:
    """A decode step in latent space (W_UK into the query, W_UV after) gives the logits of
    expanding every cached latent into per-head K/V, and the same greedy tokens."""
    path = variant(name)
    loaded = load_model(str(path), dtype=torch.float32)
    block = 4
    pool = allocate_kv_pool(loaded.config.kv_layout(block, torch.float32), 64, "cpu")
    seqs = random_prompts(3, VOCAB, min_len=5, max_len=40, seed=len(name))
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(seqs))]
    with single_torch_thread():
        entries = [SeqEntry(s, 0, t) for s, t in zip(seqs, tables, strict=True)]
        loaded.model(ForwardBatch.build(entries, block, "cpu"), pool)
        step = [
            SeqEntry([7 + i], len(s), t) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))
        ]
        decode = ForwardBatch.build(step, block, "cpu", ragged_decode=True)
        assert all(g.query_len == 1 and not g.fresh for g in decode.groups)
        latent = loaded.model(decode, pool.clone())
        _set_absorb(loaded.model, False)
        expanded = loaded.model(decode, pool.clone())
        torch.testing.assert_close(latent, expanded, atol=1e-4, rtol=0)
        prompts = family_prompts(seed=5)[:6]
        params = [SamplingParams(max_tokens=10)] * len(prompts)
        want = [o.token_ids for o in LLM(engine_config(path), loaded).generate(prompts, params)]
        _set_absorb(loaded.model, True)
        got = [o.token_ids for o in LLM(engine_config(path), loaded).generate(prompts, params)]
    assert got == want


def test_latent_pool_layout_and_sizing(variant: Callable[[str], Path]) -> None:
    """DeepSeek-V3's own shapes store 576 values per token per layer in one plane; the engine
    sizes its block budget from that row, and a block's spans cover exactly its bytes."""
    from transformers import DeepseekV3Config

    full = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]).to_dict()
    layout = config_from_hf(full).kv_layout(16, torch.bfloat16)
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 576)
    assert layout.token_bytes == 61 * 576 * 2
    offsets, lengths = layout.block_spans(10, 3, 2, [4, 5, 8])
    assert lengths.sum() == layout.payload_bytes(2, 3)
    assert list(offsets) == [(3 * 10 + b) * layout.plane_block_bytes for b in (4, 8)] + [
        (4 * 10 + b) * layout.plane_block_bytes for b in (4, 8)
    ]
    path = variant(PD_VARIANT)
    llm = LLM(
        EngineConfig(model=str(path), kv_cache_memory_mb=1, block_size=8),
        load_model(str(path), dtype=torch.float32),
    )
    core = llm.core
    assert core.layout.token_bytes == latent_bytes_per_token(path, itemsize=4)
    assert core.kv_manager.blocks.num_blocks == 2**20 // (core.layout.token_bytes * 8)
    assert tuple(core.kv_pool.shape[1:2]) == (1,)


def test_yarn_rope_and_softmax_scale_match_transformers() -> None:
    """yarn's frequencies, its cos/sin factor (mscale / mscale_all_dim) and the softmax scale
    (times mscale_all_dim's mscale squared) equal transformers' DeepSeek-V3 modules'."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    from shared.model.rotary import RotaryEmbedding

    hf_config = DeepseekV3Config(
        **{
            **_MLA,
            "hidden_size": 64,
            "q_lora_rank": 16,
            "max_position_embeddings": 1024,
            "rope_parameters": YARN,
            "architectures": ["DeepseekV3ForCausalLM"],
        }
    )
    ours = config_from_hf(hf_config.to_dict())
    assert ours.mla is not None
    assert ours.mla.softmax_scale == hf_v3.DeepseekV3Attention(hf_config, 0).scaling
    assert ours.mla.softmax_scale != ours.mla.qk_head_dim**-0.5
    hf_rope = hf_v3.DeepseekV3RotaryEmbedding(hf_config)
    positions = torch.arange(300)
    want_cos, want_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, signed_sin = RotaryEmbedding(ours, torch.device("cpu"))(positions, torch.float32)
    assert hf_rope.attention_scaling != 1.0
    assert torch.equal(cos[:, 0], want_cos[0])
    half = want_sin.shape[-1] // 2
    assert torch.equal(signed_sin[:, 0, half:], want_sin[0, :, half:])
    assert torch.equal(signed_sin[:, 0, :half], -want_sin[0, :, :half])


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_transformers(method: str) -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from shared.model.moe_hf import deepseek_v2_moe
    from shared.model.router import Router

    hf_config = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.7,
        moe_intermediate_size=8,
    )
    hf = DeepseekV2TopkRouter(hf_config)
    ours = Router(32, deepseek_v2_moe(hf_config.to_dict(), 2), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(len(method))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        ours.weight.copy_(hf.weight)
    x = torch.randn(64, 32, generator=gen)
    with torch.inference_mode():
        _, want_weights, want_ids = hf(x)
        got_weights, got_ids = ours(x)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)
    if method == "group_limited_greedy":
        assert all(len(set(row)) <= 2 for row in (got_ids // 4).tolist())


@pytest.mark.parametrize("name", ["v3-16x4-half-rope-unnormed-bias", "v2-lite-greedy-yarn-bias"])
def test_mla_export_round_trips(name: str, variant: Callable[[str], Path], tmp_path: Path) -> None:
    """export-hf writes a config.json transformers reads into the same logits (yarn and its
    softmax scale included), and pdserve loads it back to the same config and weights."""
    from pdserve.export_hf import export_hf

    source = variant(name)
    export_hf(str(source), tmp_path)
    ids = torch.tensor([list(range(3, 63))])
    with torch.inference_mode():
        want, got = load_hf_model(source)(ids).logits, load_hf_model(tmp_path)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    a, b = (load_model(str(p), dtype=torch.float32) for p in (source, tmp_path))
    assert a.config == b.config
    sa, sb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_mla_bench_quick(tmp_path: Path) -> None:
    """`pdserve bench engine --mla --quick`: both decode paths give the same greedy tokens (the
    benchmark checks), and the JSON records the pool's bytes per token against full K/V."""
    from pdserve.bench import engine

    argv = ["--mla", "--quick", "--out", str(tmp_path), "--batches", "1,3", "--context", "40"]
    result = engine.main([*argv, "--steps", "2", "--reps", "1"])
    kv = result["kv_bytes_per_token"]
    assert isinstance(kv, dict) and kv["latent"] == kv["layout"] == (64 + 16) * 4
    assert kv["full_kv"] == 4 * (32 + 16 + 32) * 4
    rows = result["rows"]
    assert isinstance(rows, list) and [r["batch"] for r in rows] == [1, 3]
    assert (tmp_path / "engine_mla.json").is_file()
