"""Where the model runs and in what precision: `--device` and `--dtype` resolved, `auto`
included (bf16 where the hardware has native bf16 units, fp32 elsewhere)."""

from __future__ import annotations

import functools
import logging
import os

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
