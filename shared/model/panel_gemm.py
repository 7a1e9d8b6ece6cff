"""GEMMs on AVX-512 CPUs whose libraries leave speed behind: kernels/panel_gemm.c on a weight
packed once, bf16 and fp32, every row count past the GEMV kernel's.

Measured on AMD Zen 5 (AVX-512 BF16, no AMX), SmolLM2's projections on two cores: bf16 ahead of
oneDNN's packed GEMMs at every row count (32 rows: 600-660 against ~480 GFLOP/s), fp32 1.6x
oneDNN at 8 rows, 1.17x at 32, 1.09x at 1,024 (docs/performance.md, "Kernels"). `auto` runs it
there: bf16 where the CPU has AVX-512 BF16 and no AMX (AMX's tile kernels in oneDNN are several
times faster than any AVX-512 loop); fp32 where it has AVX-512 and is not Intel's (Intel's
libraries are tuned for Intel's cores; not measured here). `PDSERVE_PANEL_GEMM=1` runs it
wherever the instructions exist, `0` nowhere. The packed copy replaces oneDNN's (the same bytes),
so the choice costs no memory. A row's output is the same bits alone and in any batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from shared.cdiv import cdiv
from shared.model import native
from shared.model.native import cpu_flags, cpu_vendor

log = logging.getLogger(__name__)

SWITCH = "PDSERVE_PANEL_GEMM"
CHOICES = ("auto", "1", "0")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
PROFILER_NAME = "pdserve::panel_gemm"  # the kernel's row in torch profiler tables


@functools.cache
def _library() -> ctypes.CDLL | None:
    p, i = ctypes.c_void_p, ctypes.c_int64
    signatures: native.Signatures = {"panel_width": ([], ctypes.c_int)}
    for suffix in _SUFFIX.values():
        signatures[f"panel_pack_{suffix}"] = ([p, p, i, i], ctypes.c_int)
        signatures[f"panel_gemm_{suffix}"] = ([p, i, p, p, p, i, i, i, ctypes.c_int], ctypes.c_int)
    return native.load("panel_gemm", SWITCH, "panel GEMM kernel", signatures)


def _fits(dtype: torch.dtype) -> bool:
    """Where `auto` runs the kernel for `dtype` (see the module docstring)."""
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags and "amx_bf16" not in flags
    return "avx512f" in flags and cpu_vendor() != "GenuineIntel"


@functools.cache
def chosen(dtype: torch.dtype) -> bool:
    """Whether `dtype` GEMMs past the GEMV kernel's rows run here rather than in a library."""
    choice = os.environ.get(SWITCH, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{SWITCH}={choice!r}: expected one of {CHOICES}")
    if dtype not in _SUFFIX:
        return False
    wanted = choice == "1" or (choice == "auto" and _fits(dtype))
    usable = wanted and _kernel_works(dtype)
    log.info(
        "%s GEMMs past the GEMV rows: %s (%s=%s)",
        _SUFFIX[dtype],
        "panel kernel" if usable else "libraries",
        SWITCH,
        choice,
    )
    return usable


def _kernel_works(dtype: torch.dtype) -> bool:
    """The kernel loads and this CPU has its instructions (packing a 1x2 weight succeeds)."""
    lib = _library()
    if lib is None:
        return False
    weight = torch.zeros(1, 2, dtype=dtype)
    packed = torch.zeros(lib.panel_width() * 2, dtype=dtype)
    pack_fn = getattr(lib, f"panel_pack_{_SUFFIX[dtype]}")
    return pack_fn(weight.data_ptr(), packed.data_ptr(), 1, 2) == 0


def usable(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] runs here: contiguous, the kernel chosen for its dtype, `in`
    even in bf16 (the kernel takes K in pairs)."""
    return (
        weight.is_contiguous()
        and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)
        and chosen(weight.dtype)
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in the kernel's panel layout (see kernels/panel_gemm.c)."""
    lib = _library()
    assert lib is not None
    out_features, in_features = weight.shape
    width = lib.panel_width()
    packed = weight.new_empty(cdiv(out_features, width) * width * in_features)
    pack_fn = getattr(lib, f"panel_pack_{_SUFFIX[weight.dtype]}")
    rc = pack_fn(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    assert rc == 0, "the panel kernel refused a weight `usable` accepted"
    return packed


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [rows, in] @ weight.T + bias on `pack(weight)`, x of the weight's dtype; x's rows may
    be strided."""
    lib = _library()
    assert lib is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, in_features = x.shape
    out = x.new_empty(rows, out_features)
    args = (
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    native.call(PROFILER_NAME, getattr(lib, f"panel_gemm_{_SUFFIX[x.dtype]}"), *args)
    return out
