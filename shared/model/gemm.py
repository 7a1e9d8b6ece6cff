"""`F.linear` with the weight pre-packed the way oneDNN wants it, for bf16 on CPU.

bf16 `F.linear` on CPU already runs oneDNN (AMX / AVX-512 BF16), but reorders the plain
[out, in] weight into oneDNN's blocked layout on every call. Reordering once and calling
`mkldnn._linear_pointwise` on the packed weight gives the same bits and, measured on this Xeon
(one thread, SmolLM2's shapes), runs the GEMVs of a decode step 1.4-2.6x faster at 1-8 rows and
1.1-1.7x at 32 rows, and prefill's GEMMs at parity or better. fp32 keeps `F.linear` (MKL): a
different library would change fp32 results, and fp32 tokens must not change.

Row counts above EXACT_ROWS are padded up to one of 8 sizes per octave (`padded_rows`, at most
12.5% extra rows): oneDNN builds a primitive per shape (1-5 ms each at SmolLM2's projections,
~12 ms for a new row count across a layer's shapes) and caches 1,024 of them, and every prefill
chunk has its own row count. Unpadded, random-length traffic missed that cache on every request:
bf16 prefill of random lengths 40-700 after every length had been seen once, one thread, 235-244
ms mean unpadded, 205-207 ms padded (a cache 16x larger gave the same 202-208 ms but +750 MB of
primitives for 3,300 row counts: unbounded). Cost: a repeated length that is not a bucket pads
(300 rows -> 320: ~5% on that forward); decode batches (up to EXACT_ROWS rows) keep their exact
shape. A padded call's rows may differ from an unpadded one's in the last bit for some shapes
(oneDNN's blocking depends on the row count), as they already did between chunk sizes; bf16
results are not pinned to transformers' (fp32 never takes this path).

A single row (a batch-1 decode step) goes to kernels/skinny_gemm.c instead where this CPU has
AVX-512 BF16: at one row a GEMM is one pass over its weight, and oneDNN's primitives read
SmolLM2's decode weights at 7.4 / 12-13 GB/s (1 / 2 threads) where that kernel, streaming the plain
[out, in] weight with a prefetch one band ahead, reads 10.2 / 19.4 GB/s (a sum() of the same
bytes: 11.5 / 23.4). Its sums run in another order: an output may differ from oneDNN's in its last
bf16 bit (0-0.1% of them on SmolLM2's shapes). `PDSERVE_SKINNY_GEMM=0` turns it off.

The packed copy is rebuilt whenever the weight is written in place (its version counter moves),
so loading a checkpoint into the parameters after the first forward is still seen. Not
thread-safe, like the model: one forward at a time.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from shared.engine.utils import cdiv
from shared.model import native

log = logging.getLogger(__name__)


@functools.cache
def onednn_bf16_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


@functools.cache
def skinny_library() -> ctypes.CDLL | None:
    """kernels/skinny_gemm.c, or None where it is off, cannot be built or finds no AVX-512 BF16."""
    lib = native.load("skinny_gemm", "PDSERVE_SKINNY_GEMM", "batch-1 bf16 GEMV kernel")
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.skinny_gemm.argtypes = [p, p, p, p, i, i, ctypes.c_int]
    lib.skinny_gemm.restype = ctypes.c_int
    probe = torch.zeros(1, dtype=torch.bfloat16)
    if lib.skinny_gemm(probe.data_ptr(), probe.data_ptr(), None, probe.data_ptr(), 1, 1, 1) != 0:
        return None  # built for a CPU without AVX-512 BF16
    log.info("one-row bf16 GEMMs stream their weights through a GEMV kernel (%s)", lib._name)
    return lib


def _skinny_ok(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and skinny_library() is not None


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = skinny_library()
    assert lib is not None
    out_features, in_features = weight.shape
    out = x.new_empty(1, out_features)
    lib.skinny_gemm(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), out_features, in_features, torch.get_num_threads(),
    )  # fmt: skip
    return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter and cannot change
        return 0


class PackedGemm:
    """y = x @ weight.T + bias, with `weight` packed for oneDNN when that is exact and faster."""

    __slots__ = ("_packed", "_plain", "_version", "bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        # the GEMV kernel reads the weight (and bias) as stored: contiguous rows of `in` elements
        self._plain = weight.is_contiguous() and (bias is None or bias.is_contiguous())
        self._packed: torch.Tensor | None = None
        self._version = -1

    def _use_onednn(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (
            w.dtype == torch.bfloat16
            and w.device.type == "cpu"
            and x.dim() == 2
            and onednn_bf16_available()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_onednn(x):
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1 and x.dtype == self.weight.dtype and self._plain and _skinny_ok(x):
            return _skinny(x, self.weight, self.bias)
        version = _version(self.weight)
        if self._packed is None or version != self._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._version = version
        bias = None if self.bias is None else self.bias.detach()
        rows = x.shape[0]
        out = torch.ops.mkldnn._linear_pointwise(
            pad_rows(x).contiguous(), self._packed, bias, "none", [], ""
        )
        return out if out.shape[0] == rows else out[:rows]


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to `padded_rows` (x itself when none are needed)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    return x if padded == rows else F.pad(x, (0, 0, 0, padded - rows))


EXACT_ROWS = 32  # row counts up to here (decode batches) keep a primitive each
_BUCKETS_PER_OCTAVE_LOG2 = 3  # 8 sizes per octave above EXACT_ROWS: at most 12.5% padding


def padded_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at (see the module docstring)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 1 - _BUCKETS_PER_OCTAVE_LOG2)
    return cdiv(rows, step) * step
