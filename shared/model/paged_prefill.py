"""Prefill attention read straight from the paged KV pool (kernels/paged_prefill.c), on CPU,
bf16 and fp32.

Why hand-written: torch's CPU flash attention (SDPA) runs at 35-65 GFLOP/s in bf16 on AMD Zen 4,
a fifth to a third of the same core's bf16 GEMMs, and a chunk continuing a cached context first
gathered that whole context from the pool per layer. The kernel keeps a work item's up to 32
query rows in the lanes of two vectors (no reduction across lanes), takes scores and values as
AVX-512 BF16 dot products (fp32: FMAs) straight from the pool, and runs the online softmax in
fp32 (docs/performance.md, "Kernels", for its rates against SDPA), its error against a float64
reference equal to SDPA's.

fp32 runs here only where fp32 prefill has already left transformers' bits
(`gemm.fp32_rows_onednn`: CPUs not Intel's, `PDSERVE_FP32_GEMM`): elsewhere SDPA, which is what
transformers runs, keeps prompt logits bit-equal to it. Built and loaded by
shared/model/native.py; no compiler, a failed build, a CPU without AVX-512 (BF16 for bf16) or
`PDSERVE_PAGED_PREFILL=0`: SDPA, with one log line saying why.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from shared.model import gemm, native
from shared.model.attention_groups import AttentionGroup

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256  # kernels/paged_prefill.c: MAX_D
_ARGTYPES = (
    [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
)
_ENTRY = {torch.bfloat16: "paged_prefill", torch.float32: "paged_prefill_f32"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason logged once) where it cannot be used."""
    signatures = {name: (_ARGTYPES, ctypes.c_int) for name in _ENTRY.values()}
    return native.load("paged_prefill", "PDSERVE_PAGED_PREFILL", "paged prefill kernel", signatures)


@functools.cache
def covers(dtype: torch.dtype) -> bool:
    """Whether `dtype` prefill attention runs in the kernel on this machine."""
    lib = library()
    if lib is None or dtype not in _ENTRY:
        return False
    if dtype == torch.float32 and not gemm.fp32_rows_onednn():
        return False  # SDPA keeps transformers' bits where the GEMMs keep them too
    if not _probe(getattr(lib, _ENTRY[dtype]), dtype):
        log.info("paged prefill kernel: no %s path on this CPU, SDPA", dtype)
        return False
    log.info("%s prefill attention reads the paged KV pool directly (%s)", dtype, lib._name)
    return True


def _probe(entry: Callable[..., int], dtype: torch.dtype) -> bool:
    """One 16-wide query over one key: 0 where the library covers `dtype` on this CPU."""
    q, pool = torch.zeros(1, 1, 16, dtype=dtype), torch.zeros(2, 1, 1, 1, 16, dtype=dtype)
    out = torch.zeros(1, 16, dtype=dtype)
    zero, one = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    ptrs = (t.data_ptr() for t in (q, pool, out, zero, zero, one, zero))
    return entry(*ptrs, 1, 1, 1, 1, 16, 1, 1, 16, 16, 1.0, 0, 1) == 0


def usable(q: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup) -> bool:
    head_dim = q.shape[-1]
    return (
        group.seq_starts is not None
        and q.device.type == "cpu"
        and layer_pool.dtype == q.dtype
        and layer_pool.shape[0] == 2  # K and V planes; a latent pool attends in torch (mla.py)
        and layer_pool.is_contiguous()
        and q.stride(-1) == 1
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and covers(q.dtype)
    )


def prefill_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> bool:
    """Write the group's queries' attention into their rows of `out` [T, heads * head_dim];
    False when the kernel declines (the caller then runs SDPA). q: [T, heads, head_dim]."""
    lib = library()
    assert lib is not None and group.block_tables is not None
    assert group.seq_qlens is not None and group.seq_computed is not None
    assert out.is_contiguous() and out.dtype == q.dtype
    _, num_heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = layer_pool.shape
    tables = group.block_tables
    code = native.call(
        "pdserve::paged_prefill",
        getattr(lib, _ENTRY[q.dtype]),
        q.data_ptr(),
        layer_pool.data_ptr(),
        out.data_ptr(),
        tables.data_ptr(),
        group.seq_starts.data_ptr(),
        group.seq_qlens.data_ptr(),
        group.seq_computed.data_ptr(),
        tables.shape[0],
        tables.shape[1],
        num_heads,
        kv_heads,
        head_dim,
        num_blocks,
        block_size,
        q.stride(0),
        q.stride(1),
        scale,
        window or 0,
        torch.get_num_threads(),
    )
    return code == 0
