"""y = x @ weight.T + bias on CPU, through the fastest path for the row count and dtype.

- **A few rows** (small decode batches: up to `GEMV_ROWS[dtype]`), bf16 or fp32:
  kernels/skinny_gemm.c where this CPU has AVX-512 (BF16 for bf16). At these row counts a GEMM
  is a pass over its weight, and the libraries' small-row paths read it well below the memory
  bandwidth; the kernel streams the plain [out, in] weight row by row (docs/performance.md,
  "Kernels"). `PDSERVE_SKINNY_GEMM=0` turns it off.
- **More rows, bf16 or fp32, where the libraries leave speed behind** (AVX-512 BF16 without AMX;
  fp32 on AVX-512 CPUs not Intel's): kernels/panel_gemm.c on a weight packed once into its panel
  layout, ahead of oneDNN at every row count there (shared/model/panel_gemm.py,
  `PDSERVE_PANEL_GEMM=auto|1|0`); fp32 prefill rows only where they have left MKL's bits
  anyway (`fp32_rows_onednn`, below). The paths below are what runs elsewhere.
- **bf16, more rows**: oneDNN on a weight pre-packed once. bf16 `F.linear` on CPU already runs
  oneDNN but reorders the plain weight into oneDNN's blocked layout on every call; packing once and
  calling `mkldnn._linear_pointwise` gives the same bits, faster. Row counts above EXACT_ROWS are
  padded up to one of 8 sizes per octave (`padded_rows`, at most 12.5% extra rows): oneDNN builds a
  primitive per shape (1-5 ms each at SmolLM2's projections) and caches 1,024, and every prefill
  chunk has its own row count; unpadded, random-length traffic missed that cache on every request
  (235-244 vs 205-207 ms mean per prefill of random lengths 40-700).
- **fp32, up to EXACT_ROWS rows** (decode batches): oneDNN on a packed copy too. MKL's sgemm at
  these row counts ran at a third to a half of oneDNN's speed on AMD Zen 4 (where vLLM's oneDNN
  GEMMs outran pdserve 2x in fp32). Costs a second copy of the fp32 weights.
- **fp32, more rows** (prefill): `F.linear` (MKL), the library transformers runs, so prompt
  logits keep transformers' bits; except where MKL runs a slow path (`fp32_rows_onednn`): MKL
  picks its code path by CPU vendor, and on AMD it ran SmolLM2's prefill GEMMs at 92 GFLOP/s
  where oneDNN on the packed copy ran 216 (Zen 5, one thread, 512 rows). There fp32 prefill
  GEMMs go to oneDNN too, and prompt logits are within float rounding of transformers' instead
  of equal (greedy tokens equal in every parity test). `PDSERVE_FP32_GEMM=mkl|onednn|auto`.

The kernel and oneDNN sum in other orders than MKL: a decode step's fp32 outputs may differ from
MKL's in the last bits (bf16: by one bf16 step in a few outputs). MKL itself is not
batch-invariant either (its rows at 1-2 rows differ from the same rows in a larger batch, so a
batched decode never matched transformers' one-sequence decode bit for bit); greedy tokens stay
equal to transformers' in every parity test. The packed copies are rebuilt whenever the weight is
written in place (its version counter moves), and the kernel reads the weight itself, so loading
a checkpoint into the parameters after the first forward is still seen. Not thread-safe, like
the model: one forward at a time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shared.cdiv import cdiv
from shared.model import native, panel_gemm
from shared.model.native import cpu_vendor

log = logging.getLogger(__name__)


@functools.cache
def onednn_bf16_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


@functools.cache
def skinny_library() -> ctypes.CDLL | None:
    """kernels/skinny_gemm.c, or None where it is off or cannot be built."""
    p, i, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    args = [p, i, p, p, p, i, i, i, n]
    signatures = {name: (args, ctypes.c_int) for name in ("skinny_gemm_f32", "skinny_gemm_bf16")}
    lib = native.load("skinny_gemm", "PDSERVE_SKINNY_GEMM", "small-batch GEMM kernel", signatures)
    if lib is None:
        return None
    log.info("small-batch GEMMs stream their weights through a kernel (%s)", lib._name)
    return lib


@functools.cache
def _gemv(dtype: torch.dtype) -> Callable[..., int] | None:
    """The kernel's entry point for `dtype`, or None where this CPU lacks its instructions."""
    lib = skinny_library()
    name = {torch.float32: "skinny_gemm_f32", torch.bfloat16: "skinny_gemm_bf16"}.get(dtype)
    if lib is None or name is None:
        return None
    entry = getattr(lib, name)
    probe = torch.zeros(1, dtype=dtype)  # alive until the call returns: the kernel writes it
    p = probe.data_ptr()
    return entry if entry(p, 1, p, None, p, 1, 1, 1, 1) == 0 else None


def gemv_available(dtype: torch.dtype) -> bool:
    """Whether few-row GEMMs of `dtype` run through the kernel on this machine."""
    return _gemv(dtype) is not None


# Up to how many rows the kernel beats the libraries (measured on AMD Zen 4 over SmolLM2's decode
# weights, one thread, ms for every layer's GEMMs, kernel vs oneDNN: fp32 1 row 18 vs 30, 2 rows
# 23 vs 37, 4 rows 32 vs 27; bf16 1 row 9.3 vs 17, 2 rows 10.3 vs 20.5, 4 rows 14.0 vs 15.0, 8
# rows 24 vs 21).
GEMV_ROWS = {torch.float32: 2, torch.bfloat16: 4}


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = _gemv(x.dtype)
    assert kernel is not None
    rows, (out_features, in_features) = x.shape[0], weight.shape
    out = x.new_empty(rows, out_features)
    native.call(
        "pdserve::skinny_gemm",
        kernel,
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter and cannot change
        return 0


class PackedGemm:
    """y = x @ weight.T + bias: the kernel, oneDNN on a packed weight, or `F.linear`."""

    __slots__ = ("_kind", "_packed", "_plain", "_version", "bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        # the kernel reads the weight (and bias) as stored: contiguous rows of `in` elements
        self._plain = weight.is_contiguous() and (bias is None or bias.is_contiguous())
        self._packed: torch.Tensor | None = None  # a packed copy of the weight, of `_kind`
        self._kind = ""
        self._version = -1

    def _gemv_ok(self, x: torch.Tensor) -> bool:
        return (
            x.shape[0] <= GEMV_ROWS.get(x.dtype, 0)
            and x.dtype == self.weight.dtype
            and x.stride(-1) == 1
            and self._plain
            and _gemv(x.dtype) is not None
        )

    def _panel_ok(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.weight.dtype
            and (self.bias is None or self.bias.dtype == x.dtype)
            and self._plain
            and panel_gemm.usable(self.weight)
            and (x.dtype != torch.float32 or fp32_off_mkl(x.shape[0]))
        )

    def _onednn_ok(self, x: torch.Tensor) -> bool:
        dtype = self.weight.dtype
        if dtype == torch.bfloat16:
            return onednn_bf16_available()
        return (
            dtype == torch.float32
            and fp32_off_mkl(x.shape[0])
            and torch.backends.mkldnn.is_available()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.device.type != "cpu" or self.weight.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if self._gemv_ok(x):
            return _gemv_rows(x, self.weight, self.bias)
        if self._panel_ok(x):
            packed = self._packed_as("panel")
            return panel_gemm.linear(x, packed, self._bias(), self.weight.shape[0])
        if self._onednn_ok(x):
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = onednn_linear(pad_rows(x).contiguous(), self._packed_as("onednn"), self._bias())
        return out if out.shape[0] == rows else out[:rows]

    def _packed_as(self, kind: str) -> torch.Tensor:
        """The weight packed for `kind`, rebuilt when the weight was written in place."""
        version = _version(self.weight)
        if self._packed is None or version != self._version or kind != self._kind:
            weight = self.weight.detach()
            self._packed = panel_gemm.pack(weight) if kind == "panel" else pack_onednn(weight)
            self._version, self._kind = version, kind
        return self._packed

    def _bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach()


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once into oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN on a weight from `pack_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


FP32_GEMM_CHOICES = ("auto", "mkl", "onednn")


@functools.cache
def fp32_rows_onednn() -> bool:
    """Whether fp32 GEMMs past EXACT_ROWS rows (prefill) run oneDNN rather than MKL: `auto` (the
    default of `PDSERVE_FP32_GEMM`) where the CPU is not Intel's, whose MKL path is the fast one
    (see the module docstring)."""
    choice = os.environ.get("PDSERVE_FP32_GEMM", "auto")
    if choice not in FP32_GEMM_CHOICES:
        raise ValueError(f"PDSERVE_FP32_GEMM={choice!r}: expected one of {FP32_GEMM_CHOICES}")
    vendor = cpu_vendor()
    onednn = choice == "onednn" or (choice == "auto" and vendor not in ("GenuineIntel", ""))
    log.info(
        "fp32 prefill GEMMs: %s (PDSERVE_FP32_GEMM=%s, CPU vendor %s)",
        "oneDNN" if onednn else "MKL, transformers' bits",
        choice,
        vendor or "unknown",
    )
    return onednn


def fp32_off_mkl(rows: int) -> bool:
    """Whether an fp32 GEMM of `rows` rows may leave MKL (for oneDNN or the panel kernel):
    decode batches always (MKL is not batch-invariant there either), prefill rows only where they
    are not pinned to transformers' bits (`fp32_rows_onednn`)."""
    return rows <= EXACT_ROWS or fp32_rows_onednn()


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
