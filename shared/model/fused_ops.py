"""RMSNorm (with the residual add before it), SwiGLU's product and RoPE + KV store, each one pass
over memory (kernels/fused_ops.c), on CPU, bf16 and fp32.

Why hand-written: in bf16 torch runs each of these as several element-wise ops that convert
bf16 <-> fp32 in their own pass over a fresh tensor. At 512 prompt tokens on SmolLM2's shapes
they took as long as the layer's AMX GEMMs (docs/performance.md, "Kernels"), and at decode each
op is also a dispatch (~25 per layer). The kernels round to bf16 where the torch formulas do;
RMSNorm's variance and SiLU's exp are summed / evaluated in another order, so an output may
differ from torch's in its last bf16 bit. fp32 runs the same formulas where fp32 prefill has
already left transformers' bits (`gemm.fp32_rows_onednn`: CPUs not Intel's), and torch's ops
elsewhere, whose bits are pinned to transformers'. Built by shared/model/native.py;
`PDSERVE_FUSED_OPS=0` or no compiler: torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from shared.model import gemm, native

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
PARALLEL_ELEMENTS = 1 << 16  # below this an OpenMP fork costs more than it saves
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": ([_P] * 4 + [_I] * 4 + [_F, _N], None),
    "silu_mul": ([_P] * 2 + [_I] * 3 + [_N], None),
    "rope_store": ([_P] * 7 + [_I] * 6 + [_N], ctypes.c_int),
}
_SIGNATURES |= {f"{name}_f32": signature for name, signature in _SIGNATURES.items()}
_SUFFIX = {torch.bfloat16: "", torch.float32: "_f32"}


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = native.load("fused_ops", "PDSERVE_FUSED_OPS", "fused element-wise kernels", _SIGNATURES)
    if lib is None:
        return None
    log.info("RMSNorm, SwiGLU and RoPE run fused (%s)", lib._name)
    return lib


def usable(x: torch.Tensor) -> bool:
    return (
        x.dtype in KERNEL_DTYPES
        and (x.dtype != torch.float32 or gemm.fp32_rows_onednn())
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and library() is not None
    )


def _entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> Callable[..., int | None]:
    return getattr(lib, name + _SUFFIX[dtype])


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_ELEMENTS else 1


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta in place (when given), then RMSNorm(x) * weight as a new [rows, dim] tensor.
    x, delta: [rows, dim] with unit element stride; weight: [dim] contiguous."""
    lib = library()
    assert lib is not None and weight.is_contiguous() and weight.dtype == x.dtype and x.dim() == 2
    rows, dim = x.shape
    out = x.new_empty(rows, dim)
    if delta is not None:
        assert delta.shape == x.shape and delta.stride(-1) == 1 and delta.dtype == x.dtype
    native.call(
        "pdserve::add_rms_norm",
        _entry(lib, "add_rms_norm", x.dtype),
        x.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        eps,
        _threads(rows * dim),
    )
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] rows: [rows, 2 * inter] -> [rows, inter]."""
    lib = library()
    assert lib is not None and gate_up.dim() == 2 and gate_up.shape[1] == 2 * inter
    rows = gate_up.shape[0]
    out = gate_up.new_empty(rows, inter)
    native.call(
        "pdserve::silu_mul",
        _entry(lib, "silu_mul", gate_up.dtype),
        gate_up.data_ptr(),
        out.data_ptr(),
        rows,
        inter,
        gate_up.stride(0),
        _threads(rows * inter),
    )
    return out


def rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    layer_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotated q and k heads [T, num_heads + kv_heads, D] of qkv [T, (num_heads + 2 kv) * D],
    with the rotated k and the v of every token stored at its slot of `layer_pool`
    (2, blocks, block_size, kv_heads, D). rope: cos and signed sin, [T, 1, D]."""
    lib = library()
    cos, ssin = (t.reshape(t.shape[0], -1) for t in rope)
    _, num_blocks, block_size, kv_heads, head_dim = layer_pool.shape
    num_tokens = qkv.shape[0]
    assert lib is not None and layer_pool.is_contiguous() and layer_pool.dtype == qkv.dtype
    assert cos.is_contiguous() and ssin.is_contiguous() and cos.shape == (num_tokens, head_dim)
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == num_tokens
    qk = qkv.new_empty(num_tokens, num_heads + kv_heads, head_dim)
    plane = num_blocks * block_size * kv_heads * head_dim * layer_pool.element_size()
    k_plane = layer_pool.data_ptr()
    code = native.call(
        "pdserve::rope_store",
        _entry(lib, "rope_store", qkv.dtype),
        qkv.data_ptr(),
        cos.data_ptr(),
        ssin.data_ptr(),
        qk.data_ptr(),
        k_plane,
        k_plane + plane,
        slots.data_ptr(),
        num_tokens,
        num_heads,
        kv_heads,
        head_dim,
        qkv.stride(0),
        num_blocks * block_size,
        _threads(num_tokens * (num_heads + 2 * kv_heads) * head_dim),
    )
    if code != 0:
        raise IndexError(f"a KV slot is outside the pool's {num_blocks * block_size} slots")
    return qk
