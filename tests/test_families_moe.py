"""Mixture-of-experts models against transformers: Mixtral, Qwen3-MoE and Qwen2-MoE (prefill
logits, greedy generation through `LLM`, P/D with two prefill nodes, seeded sampling P/D =
colocated, export round trip), and the routers alone against transformers' modules on random
inputs, DeepSeek-V3's grouped sigmoid router and its shared experts included.

Tiny random checkpoints built with transformers (tests/support/checkpoints.py): several
expert counts and top-k, windows, a dense first layer (`mlp_only_layers`), a sparse step,
`norm_topk_prob` on and off, and Qwen2-MoE's gated shared expert.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.client import generate
from pdserve.export_hf import export_hf
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from shared.model.moe import SparseMoe
from shared.model.moe_hf import deepseek_moe
from tests.engine_helpers import hf_greedy, random_max_tokens
from tests.sampling_reference import pd_generate
from tests.support.checkpoints import load_hf_model
from tests.support.cluster import pd_cluster
from tests.test_families_parity import (
    WINDOW,
    family_prompts,
    greedy_matches_transformers,
)
from tests.test_families_parity import (
    test_prefill_logits_match_transformers as prefill_logits_match,
)
from tests.test_sampling_seeded import assert_same, by_request, mixed_params

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "mixtral-4x2": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral-8x3-window-tied": (
        "mixtral",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 3,
            "intermediate_size": 48,
            "sliding_window": WINDOW,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3moe-8x3-dense-first-norm": (
        "qwen3_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "head_dim": 32,
        },
    ),
    "qwen3moe-4x2-step2-mqa-unnormed": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 2,  # layer 0 dense, layer 1 experts
            "norm_topk_prob": False,
            "num_key_value_heads": 1,
            "head_dim": 24,
        },
    ),
    "qwen2moe-8x2-shared-window": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [1],
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 2,  # layer 0 windowed, 1 and 2 global
        },
    ),
}
PD_VARIANTS = [
    "mixtral-8x3-window-tied",
    "qwen3moe-8x3-dense-first-norm",
    "qwen2moe-8x2-shared-window",
]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_prefill_logits_match_transformers(name: str, checkpoint: Callable[..., Path]) -> None:
    arch, kwargs = VARIANTS[name]
    prefill_logits_match(name, lambda _: checkpoint(arch, **kwargs))


# one router layer's nearest tie: (gap, "token t: expert a score vs expert b score"), from the
# transformers model, the router module and what it returned
LayerTie = Callable[[torch.nn.Module, torch.nn.Module, tuple[torch.Tensor, ...]], tuple[float, str]]


def nearest_router_tie(path: Path, ids: list[int], layer_tie: LayerTie) -> str:
    """Where transformers' routers came closest to choosing another expert over `ids`, to tell
    a tie from a bug: `layer_tie` scores each router layer's nearest tie, the smallest wins."""
    hf = load_hf_model(path)
    ties: list[tuple[float, str]] = []

    def hook(layer: str, module: torch.nn.Module) -> Callable[..., None]:
        def record(_module: object, _args: object, out: tuple[torch.Tensor, ...]) -> None:
            gap, where = layer_tie(hf, module, out)
            ties.append((gap, f"{layer} {where}"))

        return record

    handles = [
        m.register_forward_hook(hook(n, m)) for n, m in hf.named_modules() if n.endswith("mlp.gate")
    ]
    with torch.inference_mode():
        hf(torch.tensor([ids]))
    for h in handles:
        h.remove()
    gap, where = min(ties)
    return f"closest router tie {gap:.2e} at {where}"


def softmax_top_k_tie(
    hf: torch.nn.Module, _module: torch.nn.Module, out: tuple[torch.Tensor, ...]
) -> tuple[float, str]:
    """The k-th and (k+1)-th softmax scores of the nearest tie."""
    top_k = hf.config.num_experts_per_tok
    probs, experts = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True)
    gaps = probs[:, top_k - 1] - probs[:, top_k]
    t = int(gaps.argmin())
    a, b = int(experts[t, top_k - 1]), int(experts[t, top_k])
    return float(gaps[t]), (
        f"token {t}: expert {a} {float(probs[t, top_k - 1]):.8f} vs "
        f"expert {b} {float(probs[t, top_k]):.8f}"
    )


def closest_router_tie(path: Path, ids: list[int]) -> str:
    return nearest_router_tie(path, ids, softmax_top_k_tie)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_greedy_generation_matches_transformers(
    name: str, variant: Callable[[str], Path]
) -> None:
    greedy_matches_transformers(variant(name), name, closest_router_tie)


@pytest.mark.parametrize("name", PD_VARIANTS)
def test_moe_pd_matches_transformers_and_colocated_sampling(
    name: str, variant: Callable[[str], Path]
) -> None:
    """Two prefill nodes over gRPC: greedy tokens equal transformers', seeded sampling (every
    feature) equals the colocated engine's."""
    path = variant(name)
    prompts = family_prompts(seed=len(name))[:8]
    max_tokens = random_max_tokens(8, hi=12, seed=len(name) + 1)
    sampled = mixed_params(8, seed=31)
    llm = LLM(EngineConfig(model=str(path), num_kv_blocks=512), load_model(str(path)))
    colocated = by_request(llm.generate(prompts, sampled))
    prefill = EngineConfig(model=str(path), num_kv_blocks=512, max_num_tokens=48)

    async def body() -> None:
        async with pd_cluster(path, num_prefill=2, prefill_engine=prefill) as c:
            greedy = await asyncio.gather(
                *(
                    generate(c.targets[0], p, max_tokens=m, timeout=120)
                    for p, m in zip(prompts, max_tokens, strict=True)
                )
            )
            for p, m, r in zip(prompts, max_tokens, greedy, strict=True):
                assert r.token_ids == hf_greedy(path, p, m), f"prompt of {len(p)} tokens"
            got = await asyncio.gather(
                *(pd_generate(c.targets[0], p, s) for p, s in zip(prompts, sampled, strict=True))
            )
            for g, w in zip(got, colocated, strict=True):
                assert len(g) == len(w)
                for a, b in zip(g, w, strict=True):
                    assert_same(a, b)
            assert all(node.core.num_steps > 0 for node in c.prefills)
            await c.assert_idle_and_conserved()

    asyncio.run(body())


@pytest.mark.parametrize(
    "name",
    ["mixtral-8x3-window-tied", "qwen3moe-4x2-step2-mqa-unnormed", "qwen2moe-8x2-shared-window"],
)
def test_moe_export_round_trips(name: str, variant: Callable[[str], Path], tmp_path: Path) -> None:
    """export-hf writes the experts under the names transformers' save_pretrained uses: it
    loads them into the same logits, and pdserve loads them back to the same weights."""
    source = variant(name)
    export_hf(str(source), tmp_path)
    ids = torch.tensor([list(range(3, 63))])
    with torch.inference_mode():
        want, got = load_hf_model(source)(ids).logits, load_hf_model(tmp_path)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    a, b = (
        load_model(str(source), dtype=torch.float32),
        load_model(str(tmp_path), dtype=torch.float32),
    )
    assert a.config == b.config
    sa, sb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


DEEPSEEK_ROUTERS: dict[str, dict[str, object]] = {
    "grouped-8x4-of-2": {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
    "grouped-16x6-of-3-unnormed": {
        "n_routed_experts": 16,
        "n_group": 8,
        "topk_group": 3,
        "num_experts_per_tok": 6,
        "norm_topk_prob": False,
        "n_shared_experts": 2,
    },
    "ungrouped-8x2": {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2},
}


def deepseek_pair(overrides: dict[str, object]) -> tuple[torch.nn.Module, SparseMoe]:
    """transformers' DeepseekV3MoE with random weights (the correction bias too) and pdserve's
    layer built from the same config.json keys, holding the same weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    base = {
        "hidden_size": 32,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 2,
    }
    hf_config = DeepseekV3Config(**{**base, **overrides})
    gen = torch.Generator().manual_seed(7)
    hf = DeepseekV3MoE(hf_config).eval()
    with torch.no_grad():
        for tensor in (*hf.parameters(), *hf.buffers()):
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    d = hf_config.to_dict()
    moe = deepseek_moe(d, hf_config.num_hidden_layers)
    assert moe.dense_layers == (0,) and moe.sparse(1)
    config = ModelConfig(
        architecture="DeepseekV3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        moe=moe,
    )
    ours = SparseMoe(config, torch.device("cpu"), torch.float32)
    shared = ours.shared_experts
    assert shared is not None
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        assert ours.gate.e_score_correction_bias is not None
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.gate_up_weight.copy_(hf.experts.gate_up_proj)
        ours.experts.down_weight.copy_(hf.experts.down_proj)
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(shared, part).weight.copy_(getattr(hf.shared_experts, part).weight)
    return hf, ours


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weights, ids) sorted by expert id: `topk(sorted=False)` fixes no order."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("name", list(DEEPSEEK_ROUTERS))
def test_deepseek_router_and_moe_match_transformers(name: str) -> None:
    hf, ours = deepseek_pair(DEEPSEEK_ROUTERS[name])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(len(name)))
    with torch.inference_mode():
        _, want_weights, want_ids = hf.gate(x)
        got_weights, got_ids = ours.gate(x)
        want_out, got_out = hf(x.unsqueeze(0))[0], ours(x)
    want_weights, want_ids = by_expert(want_weights, want_ids)
    got_weights, got_ids = by_expert(got_weights, got_ids)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_weights, want_weights)
    # grouped: every chosen expert lies in one of the token's topk_group groups
    per_group = ours.gate.moe.num_experts // ours.gate.moe.n_group
    assert all(len(set(row)) <= ours.gate.moe.topk_group for row in (got_ids // per_group).tolist())
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixtral-8x3-window-tied", "qwen3moe-4x2-step2-mqa-unnormed"])
def test_softmax_router_matches_transformers_in_bf16(
    name: str, variant: Callable[[str], Path]
) -> None:
    """Mixtral keeps its routing weights fp32, Qwen3-MoE casts them to the model dtype: the
    same weights and experts as transformers' router modules on bf16 inputs."""
    path = variant(name)
    hf = load_hf_model(path).to(torch.bfloat16)
    ours = load_model(str(path), dtype=torch.bfloat16).model
    layer = 1  # sparse in both
    hf_gate, our_gate = hf.model.layers[layer].mlp.gate, ours.model.layers[layer].mlp.gate
    x = torch.randn(96, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _, want_weights, want_ids = hf_gate(x.bfloat16())
        got_weights, got_ids = our_gate(x.bfloat16())
    assert got_weights.dtype == want_weights.dtype
    assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)


def test_moe_bench_quick(tmp_path: Path) -> None:
    """`pdserve bench engine --moe --quick`: both expert paths give the same greedy tokens (the
    benchmark checks) and the JSON records a rate per path and batch."""
    from pdserve.bench import engine

    argv = ["--moe", "--quick", "--out", str(tmp_path), "--batches", "1,6", "--steps", "3"]
    result = engine.main([*argv, "--reps", "1"])
    rows = result["rows"]
    assert isinstance(rows, list) and [r["batch"] for r in rows] == [1, 6]
    assert all(r["batched_tokens_per_s"] > 0 and r["per_token_tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "engine_moe.json").is_file()
