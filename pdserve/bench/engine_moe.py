"""Decode tokens/s of a mixture-of-experts model through the colocated engine: the batched
expert path (tokens grouped by expert, one GEMM pair per active expert) vs a per-token loop
(each token's experts one row at a time), same weights, same run.

The model has Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts, top-8, expert width 768,
32 query / 4 KV heads of 128) with dummy weights, 1 layer and a small vocabulary by default, so
it fits in a few GB of fp32 and runs in about a minute. Both paths must give the same greedy
tokens. Decode rate: the tokens of the steps after every prompt has its first token, over
their time, so prompt processing drops out.

    pdserve bench engine --moe [--quick] [--out bench_out] [--batches 1,8,32] [--layers 1]
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.bench.support.decode_paths import (
    DecodePaths,
    compare_batches,
    dummy_model,
    parse_args,
    write_result,
)
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.model.config import ModelConfig
from shared.model.loader import LoadedModel
from shared.model.moe import ExpertBank, SparseMoe
from shared.model.moe_config import MoeConfig

PROMPT_LEN = 16
# Qwen3-30B-A3B's layer; `--quick`: a toy of the same structure
SHAPES = {
    "full": {
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "experts": 128,
        "top_k": 8,
        "expert_width": 768,
        "vocab": 4096,
    },
    "quick": {
        "hidden": 128,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "experts": 16,
        "top_k": 4,
        "expert_width": 64,
        "vocab": 512,
    },
}


def moe_config(shape: dict[str, int], layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=3 * shape["hidden"],  # the dense width; every layer has experts
        num_layers=layers,
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=1024,
        qk_norm=True,
        moe=MoeConfig(
            num_experts=shape["experts"],
            top_k=shape["top_k"],
            intermediate_size=shape["expert_width"],
            norm_topk_prob=True,
            weights_in_model_dtype=True,
        ),
    )


class PerTokenExperts(nn.Module):
    """The baseline: every (token, expert) pair as its own one-row GEMM pair, summed per token in
    rank order."""

    def __init__(self, bank: ExpertBank) -> None:
        super().__init__()
        self.bank = bank

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for t, (token_ids, token_weights) in enumerate(zip(ids.tolist(), weights, strict=True)):
            rows = [self.bank.run_expert(e, x[t : t + 1]) for e in token_ids]
            total = rows[0] * token_weights[0]
            for r in range(1, len(rows)):
                total = total + rows[r] * token_weights[r]
            out[t] = total[0]
        return out


def pack_experts(loaded: LoadedModel) -> None:
    """Run every expert once, so that neither path pays for packing weights it meets first."""
    row = torch.zeros(1, loaded.config.hidden_size)
    for layer in loaded.model.model.layers:
        if isinstance(layer.mlp, SparseMoe):
            bank = layer.mlp.experts
            for expert in range(len(bank.gate_up_gemms)):
                bank.run_expert(expert, row)


def use_experts(loaded: LoadedModel, per_token: bool) -> None:
    for layer in loaded.model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            bank = mlp.experts.bank if isinstance(mlp.experts, PerTokenExperts) else mlp.experts
            mlp.experts = PerTokenExperts(bank) if per_token else bank


def main(argv: list[str] | None = None) -> dict[str, object]:
    a = parse_args(argv, __doc__.splitlines()[0], batches="1,8,32", reps=3)
    shape = SHAPES["quick" if a.quick else "full"]
    config = moe_config(shape, a.layers)
    loaded = dummy_model(config)
    engine = EngineConfig(
        model="moe-dummy",
        num_kv_blocks=512,
        max_batch_size=64,
        max_num_tokens=1024,
        dtype="float32",
    )
    llm = LLM(engine, loaded)
    pack_experts(loaded)
    paths = DecodePaths(
        ("batched", "per_token"),
        ("batched experts", "per-token loop"),
        lambda path: use_experts(loaded, per_token=path == "per_token"),
    )
    rows = compare_batches(llm, paths, a.batches, a.steps, a.reps, PROMPT_LEN)
    head: dict[str, object] = {
        "benchmark": "engine_moe_decode",
        "shape": shape,
        "layers": a.layers,
        "steps": a.steps,
        "reps": a.reps,
        "prompt_len": PROMPT_LEN,
    }
    return write_result(llm, a.out / "engine_moe.json", head, rows)


if __name__ == "__main__":
    main()
