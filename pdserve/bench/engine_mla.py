"""KV bytes per token of multi-head latent attention against the same model with full per-head
K/V, and decode tokens/s through the colocated engine with attention in latent space (the
up-projections absorbed) vs expanded (every cached latent up-projected into K/V each step).

Bytes per token come from the engine's own pool (what sizes its block budget) and, for
DeepSeek-V3 and V2-Lite's published shapes, from their configs' layouts; the full-K/V figure is
layers x heads x (qk_head_dim + v_head_dim) values. The measured model has V2-Lite's attention
(hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no q LoRA) with dummy
weights, 8 experts, 1 layer by default; both decode paths must give the same greedy tokens.

    pdserve bench engine --mla [--quick] [--out bench_out] [--batches 1,8] [--context 1024]
"""

from __future__ import annotations

from pdserve.bench.support.decode_paths import (
    DecodePaths,
    compare_batches,
    dummy_model,
    parse_args,
    write_result,
)
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.kv.layout import dtype_name
from shared.model.config import ModelConfig
from shared.model.mla import LatentAttention
from shared.model.mla_config import MlaConfig
from shared.model.moe_config import SIGMOID, MoeConfig

SHAPES = {
    "full": {
        "hidden": 2048,
        "heads": 16,
        "kv_lora": 512,
        "q_lora": 0,
        "rope": 64,
        "nope": 128,
        "v": 128,
        "experts": 8,
        "top_k": 2,
        "expert_width": 1408,
        "vocab": 4096,
    },
    "quick": {
        "hidden": 128,
        "heads": 4,
        "kv_lora": 64,
        "q_lora": 48,
        "rope": 16,
        "nope": 32,
        "v": 32,
        "experts": 8,
        "top_k": 2,
        "expert_width": 64,
        "vocab": 512,
    },
}
# published shapes: (layers, heads, kv_lora_rank, qk_rope, qk_nope, v_head_dim)
PUBLISHED = {
    "DeepSeek-V3": (61, 128, 512, 64, 128, 128),
    "DeepSeek-V2-Lite": (27, 16, 512, 64, 128, 128),
}


def mla_config(shape: dict[str, int], layers: int) -> ModelConfig:
    mla = MlaConfig(
        kv_lora_rank=shape["kv_lora"],
        qk_nope_head_dim=shape["nope"],
        qk_rope_head_dim=shape["rope"],
        v_head_dim=shape["v"],
        q_lora_rank=shape["q_lora"] or None,
        softmax_scale=(shape["nope"] + shape["rope"]) ** -0.5,
    )
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM",
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=3 * shape["hidden"],
        num_layers=layers,
        num_heads=shape["heads"],
        num_kv_heads=shape["heads"],
        head_dim=shape["rope"],
        max_position_embeddings=8192,
        mla=mla,
        moe=MoeConfig(
            num_experts=shape["experts"],
            top_k=shape["top_k"],
            intermediate_size=shape["expert_width"],
            scoring=SIGMOID,
            score_correction_bias=True,
            shared_intermediate_size=shape["expert_width"],
        ),
    )


def full_kv_bytes(layers: int, heads: int, rope: int, nope: int, v: int, itemsize: int) -> int:
    """Per token: every head's key (nope + rope) and value in every layer."""
    return layers * heads * (nope + rope + v) * itemsize


def published_rows(itemsize: int) -> list[dict[str, object]]:
    rows = []
    for name, (layers, heads, kv_lora, rope, nope, v) in PUBLISHED.items():
        latent = layers * (kv_lora + rope) * itemsize
        full = full_kv_bytes(layers, heads, rope, nope, v, itemsize)
        rows.append(
            {
                "model": name,
                "latent_bytes_per_token": latent,
                "full_kv_bytes_per_token": full,
                "ratio": full / latent,
            }
        )
    return rows


def set_absorb(llm: LLM, absorb: bool) -> None:
    for module in llm.core.model.modules():
        if isinstance(module, LatentAttention):
            module.absorb = absorb


def main(argv: list[str] | None = None) -> dict[str, object]:
    a = parse_args(argv, __doc__.splitlines()[0], batches="1,8", reps=2, context=1024)
    shape = SHAPES["quick" if a.quick else "full"]
    config = mla_config(shape, a.layers)
    blocks = max(a.batches) * -(-(a.context + a.steps + 1) // 16) + 8
    engine = EngineConfig(
        model="mla-dummy",
        num_kv_blocks=blocks,
        max_batch_size=max(a.batches),
        max_num_tokens=max(1024, a.context),
        dtype="float32",
    )
    llm = LLM(engine, dummy_model(config))
    layout, pool = llm.core.layout, llm.core.kv_pool
    itemsize = pool.element_size()
    measured = pool.nbytes // (pool.shape[2] * layout.block_size)
    full = full_kv_bytes(
        a.layers, shape["heads"], shape["rope"], shape["nope"], shape["v"], itemsize
    )
    print(
        f"engine pool ({dtype_name(pool.dtype)}, {a.layers} layer): {measured} B/token latent "
        f"vs {full} B/token full K/V ({full / measured:.1f}x)"
    )
    published = published_rows(itemsize=2)
    for row in published:
        print(
            f"{row['model']} (bf16): {row['latent_bytes_per_token']} B/token latent vs "
            f"{row['full_kv_bytes_per_token']} B/token full K/V ({row['ratio']:.1f}x)"
        )
    paths = DecodePaths(
        ("latent", "expanded"),
        ("latent decode", "expanded"),
        lambda path: set_absorb(llm, path == "latent"),
    )
    where = f", context {a.context}"
    rows = compare_batches(llm, paths, a.batches, a.steps, a.reps, a.context, where)
    head: dict[str, object] = {
        "benchmark": "engine_mla",
        "shape": shape,
        "layers": a.layers,
        "context": a.context,
        "steps": a.steps,
        "kv_bytes_per_token": {
            "latent": measured,
            "full_kv": full,
            "layout": layout.token_bytes,
            "ratio": full / measured,
            "dtype": dtype_name(pool.dtype),
        },
        "published_bf16": published,
    }
    return write_result(llm, a.out / "engine_mla.json", head, rows)


if __name__ == "__main__":
    main()
