"""Start-up configuration, one dataclass per role, validated before anything is built."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from shared.model.native import cpu_flags

log = logging.getLogger(__name__)

# Overrides what `--dtype auto` picks (float32, bfloat16 or float16); the test suite sets it to
# float32 so parity tests, and the node processes they start, compare fp32 with fp32.
AUTO_DTYPE_ENV = "PDSERVE_AUTO_DTYPE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """AMX (amx_bf16) or AVX-512 BF16 (avx512_bf16) in the CPU's flags: bf16 GEMMs then run on
    native units (about 4x fp32's prefill here). /proc/cpuinfo first; torch's own probe where
    there is no /proc (macOS)."""
    flags = cpu_flags()
    if flags:
        return "amx_bf16" in flags or "avx512_bf16" in flags
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


@functools.cache
def auto_dtype(device_type: str) -> torch.dtype:
    """What `--dtype auto` means on this machine (logged once per device type)."""
    override = os.environ.get(AUTO_DTYPE_ENV)
    if override:
        if override not in _DTYPES:
            raise ValueError(f"{AUTO_DTYPE_ENV}={override!r}: use one of {sorted(_DTYPES)}")
        dtype, why = _DTYPES[override], f"{AUTO_DTYPE_ENV} is set"
    elif device_type == "cuda":
        dtype, why = torch.bfloat16, "CUDA"
    elif cpu_has_fast_bf16():
        dtype, why = torch.bfloat16, "the CPU has AMX / AVX-512 BF16"
    else:
        dtype, why = torch.float32, "the CPU has no AMX / AVX-512 BF16"
    log.info("dtype auto -> %s on %s (%s; override with --dtype)", dtype, device_type, why)
    return dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda[:N]")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return auto_dtype(device.type)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


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
