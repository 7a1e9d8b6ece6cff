"""Decode attention read straight from the paged KV pool (kernels/paged_decode.c), on CPU.

Why hand-written: torch has no paged attention on CPU, so a decode step gathered every
sequence's K/V blocks into a padded copy per layer and ran SDPA over the copy. At SmolLM2's
shapes under serving load (batch ~30, ~300-token contexts) that gather was 15% of the decode
engine's time and attention 27% (py-spy, docs/performance.md). The kernel reads each key and
value once, where it lies, with fp32 accumulation.

It is loaded by shared/model/native.py (the best prebuilt CPU variant, or one built at first start
with the system C compiler; on torch's OpenMP runtime and thread count). No library and no
compiler, a failed build or `PDSERVE_PAGED_DECODE=0`: attention keeps the gather + SDPA path, and
/version says why.

Used for bf16 and fp32 decode groups. It sums in another order than SDPA, so an fp32 decode
step's attention may differ from SDPA's in the last bits: as the decode GEMMs already do
(shared/model/gemm.py); fp32 prefill keeps SDPA, and greedy tokens stay equal to transformers'
in every parity test.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from shared.model import attention_choice, native
from shared.model.attention_groups import AttentionGroup

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_BF16 = {torch.bfloat16: 1, torch.float32: 0}
_ARGTYPES = (
    [ctypes.c_void_p] * 5
    + [ctypes.c_int64] * 9
    + [ctypes.c_float, ctypes.c_int64]
    + [ctypes.c_int] * 2
)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason logged once) where it cannot be used."""
    signatures = {"paged_decode": (_ARGTYPES, ctypes.c_int)}
    lib = native.load("paged_decode", "PDSERVE_PAGED_DECODE", "paged decode kernel", signatures)
    if lib is None:
        return None
    log.info("decode attention reads the paged KV pool directly (%s)", lib._name)
    return lib


def reads_ragged(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention in `dtype` on `device` runs in this kernel, which reads each
    sequence's own context: decode rows then need no grouping by length (ForwardBatch.build).
    Not where the measured choice (shared/model/attention_choice.py) gave decode another path."""
    return (
        device.type == "cpu"
        and dtype in KERNEL_DTYPES
        and attention_choice.path("decode") == "native"
        and library() is not None
    )


def usable(q: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup) -> bool:
    return (
        group.query_len == 1
        and not group.fresh
        and reads_ragged(q.device, q.dtype)
        and layer_pool.dtype == q.dtype
        and layer_pool.shape[0] == 2  # K and V planes; a latent pool attends in torch (mla.py)
        and layer_pool.is_contiguous()
        and q.stride(-1) == 1
    )


def decode_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int | None,
) -> torch.Tensor | None:
    """[G, heads * head_dim]: the group's single queries over their paged context, or None when
    the kernel declines the shape (the caller then runs SDPA). q: [T, heads, head_dim]."""
    lib = library()
    assert lib is not None and group.kv_blocks is not None
    rows = q if group.query_rows is None else q.index_select(0, group.query_rows)
    n_seqs, num_heads, head_dim = rows.shape
    _, num_blocks, block_size, kv_heads, _ = layer_pool.shape
    blocks = group.kv_blocks.view(n_seqs, -1)
    pos = group.query_pos[:, 0].contiguous()
    out = rows.new_empty(n_seqs, num_heads * head_dim)
    code = native.call(
        "pdserve::paged_decode",
        lib.paged_decode,
        rows.data_ptr(),
        layer_pool.data_ptr(),
        out.data_ptr(),
        blocks.data_ptr(),
        pos.data_ptr(),
        n_seqs,
        blocks.shape[1],
        num_heads,
        kv_heads,
        head_dim,
        num_blocks,
        block_size,
        rows.stride(0),
        rows.stride(1),
        scale,
        window or 0,
        _BF16[q.dtype],
        torch.get_num_threads(),
    )
    return out if code == 0 else None
