"""Start-up configuration, one dataclass per role, validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.speculative.config import SpeculativeConfig
from shared.model.device import resolve_device, resolve_dtype


@dataclass(frozen=True)
class EngineConfig:
    """What every node that runs the model needs: model, KV pool, batching limits."""

    model: str = "tiny"
    block_size: int = 16
    # the KV pool: num_kv_blocks, else kv_cache_memory_mb, else kv_cache_memory_fraction of the
    # memory free after the weights load (shared/engine/runtime/kv_budget.py)
    num_kv_blocks: int = 0
    kv_cache_memory_mb: int = 0
    kv_cache_memory_fraction: float = 0.0  # 0: the device's default (0.1 on CPU, 0.9 on CUDA)
    max_batch_size: int = 32
    max_num_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int = 0  # 0: the smaller of the model's context and the pool's tokens
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    cuda_graphs: bool = True  # decode steps through CUDA graphs on CUDA; ignored on CPU
    # speculative decoding of greedy requests (shared/engine/speculative/); None: off
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (PEFT directories) served beside the base model: ((name, path), ...); with
    # max_loras > 0 the model gets that many adapter slots of rank <= max_lora_rank
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0  # 0: as many as lora_modules
    max_lora_rank: int = 16

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        if self.kv_cache_memory_mb < 0:
            raise ValueError(f"kv_cache_memory_mb must be >= 0, got {self.kv_cache_memory_mb}")
        if not 0.0 <= self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                "kv_cache_memory_fraction must be in (0, 1] (0: the device's default), got "
                f"{self.kv_cache_memory_fraction}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not self.model:
            raise ValueError("model must be 'tiny' or a local Hugging Face model directory")
        resolve_dtype(self.dtype, resolve_device(self.device))
        if self.speculative is not None:
            self.speculative.validate()
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras}, "
                f"{self.max_lora_rank}"
            )
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or self.model in names:
            raise ValueError(f"lora_modules names must be unique and not the model's: {names}")

    @property
    def lora_slots(self) -> int:
        return max(self.max_loras, len(self.lora_modules))
