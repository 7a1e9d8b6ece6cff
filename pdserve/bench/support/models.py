"""Models the TTFT and serving benchmarks run: the built-in `tiny` and `medium`, a dummy-weight
Llama checkpoint written locally with transformers from a config (random weights, nothing is
downloaded) that is large enough for a 1k-token prefill to take a few hundred ms on one core of
the 2-core CI machines (so the KV handoff is measured against a prefill of realistic weight)."""

from __future__ import annotations

from dataclasses import dataclass
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
    raise ValueError(f"unknown benchmark model {name!r}; use tiny or medium")
