"""Transparent huge pages for the KV pool on CPU.

Decode attention reads each sequence's blocks where they lie in the pool, and a sequence's blocks
are scattered over it (they come from a free list shared by every request). With 4 KiB pages each
block costs TLB misses: a 2 GiB pool is 512k pages against a second-level TLB of a few thousand
entries, and SmolLM2's 6 KiB key (or value) block of one layer spans two or three of them.
Measured with the paged decode kernel on Zen 5 (SmolLM2 bf16, 32 sequences of 330 tokens, 30
layers, blocks scattered over a 2 GiB pool, one thread; docs/performance.md): 26-33 ms a step with
4 KiB pages, 21-22 with 2 MiB pages (15 with every sequence's blocks contiguous).

So the pool is advised MADV_HUGEPAGE before its first touch, then zeroed: the kernel backs it
with 2 MiB pages where transparent huge pages are `madvise` or `always` (nothing changes where
they are `never`, or off Linux). The pool is written in full over its life, so nothing is wasted.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14  # <sys/mman.h>
HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB base pages


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MiB-aligned interior of CPU tensor `t` (before it is
    first touched); whether the kernel took the advice."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return False
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    stop = end // HUGE_PAGE * HUGE_PAGE
    if stop <= start:
        return False  # smaller than a huge page: nothing to advise
    if madvise(start, stop - start, MADV_HUGEPAGE) != 0:
        log.info("KV pool: no huge pages (madvise: errno %d)", ctypes.get_errno())
        return False
    return True


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on CPU, on huge pages where the kernel gives them."""
    t = torch.empty(shape, dtype=dtype)
    advise(t)
    return t.zero_()
