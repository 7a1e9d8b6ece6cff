"""Models the TTFT and serving benchmarks run: the built-in `tiny` and `medium`, a dummy-weight
Llama checkpoint written locally with transformers from a config (random weights, nothing is
downloaded) that is large enough for a 1k-token prefill to take a few hundred ms on one core of
the 2-core CI machines (so the KV handoff is measured against a prefill of realistic weight).
`bench profile` and `bench plan-check` also take any model a node takes (`smollm2`, a GGUF file,
a Hugging Face directory): what they need to know of it is asked of the first node started with
it (`described`), which has read it anyway."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

MEDIUM_CONFIG: dict[str, int] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8448,  # 8k prompts plus a few output tokens
}


@dataclass(frozen=True)
class BenchModel:
    name: str
    spec: str  # what --model gets: "tiny" or a checkpoint directory
    max_context: int
    prompt_vocab: int  # prompts draw token ids from [0, prompt_vocab)
    kv_bytes_per_token: int  # float32 KV on CPU, all layers, K and V


def resolve(name: str, cache_dir: Path) -> BenchModel:
    if name == "tiny":
        # 4 layers x 2 KV heads x head_dim 32 x K,V x fp32
        return BenchModel("tiny", "tiny", 4096, 256, 4 * 2 * 32 * 2 * 4)
    if name == "medium":
        from pdserve.bench.support.checkpoints import cached_checkpoint

        path = cached_checkpoint(cache_dir, "llama", seed=0, **MEDIUM_CONFIG)
        c = MEDIUM_CONFIG
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        kv = c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 4
        return BenchModel("medium", str(path), c["max_position_embeddings"], c["vocab_size"], kv)
    if name != "smollm2" and not Path(name).exists():
        raise ValueError(
            f"unknown benchmark model {name!r}: tiny, medium, smollm2, a GGUF file or a model "
            "directory"
        )
    return BenchModel(name, name, 0, 0, 0)  # described by a node once one runs


async def described(model: BenchModel, target: str) -> BenchModel:
    """`model` with its context, vocabulary and KV bytes per token as the node at `target` (a
    decode or colocated node serving it) reports them; a built-in one as it is. The bytes count
    a K and a V plane per KV head (the layout message does not say a latent-attention model's
    pool has one: its bytes per token read twice the pushed ones)."""
    if model.max_context:
        return model
    from pdserve.client import get_model_info
    from shared.kv.layout import KvLayout

    info = await get_model_info(target, timeout=60)
    kv = info.kv_layout
    layout = KvLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.dtype)
    return replace(
        model,
        max_context=info.max_context,
        prompt_vocab=info.vocab_size,
        kv_bytes_per_token=layout.token_bytes,
    )
