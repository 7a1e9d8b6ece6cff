"""Start-up configuration, one dataclass per role, validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.device import resolve_device, resolve_dtype


@dataclass(frozen=True)
class EngineConfig:
    """What every node that runs the model needs: model, KV pool, batching limits."""

    model: str = "tiny"
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size the pool from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    max_batch_size: int = 32
    max_num_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int = 0  # 0: the model's own maximum context
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    cuda_graphs: bool = True  # decode steps through CUDA graphs on CUDA; ignored on CPU

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if self.num_kv_blocks == 0 and self.kv_cache_memory_mb <= 0:
            raise ValueError("set num_kv_blocks or a positive kv_cache_memory_mb")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not self.model:
            raise ValueError("model must be 'tiny' or a local Hugging Face model directory")
        resolve_dtype(self.dtype, resolve_device(self.device))
