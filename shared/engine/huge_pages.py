"""Zeroed CPU tensors backed by transparent huge pages, for the KV pool.

Decode attention reads every sequence's K/V blocks at random places in a pool of hundreds of MB.
With 4 KiB pages each block costs TLB misses (a 6 KiB bf16 block of SmolLM2 spans two pages, for
K and again for V); on 2 MiB pages the decode kernel over a 755 MB pool with blocks in random
order took 129-160 instead of 163-246 ns per key (batch 32, contexts 180-430, one thread, three
runs; docs/performance.md, section 6). torch's CPU allocator gives no
control over this, so the pool is an anonymous mapping, used from a 2 MiB boundary and advised
MADV_HUGEPAGE (these machines' THP setting is "madvise"); where the kernel refuses the advice
the memory is the same, on normal pages. An anonymous mapping is zero-filled by the kernel, so
nothing is touched before use. The tensor holds the mapping; it is unmapped with the tensor.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on CPU, on 2 MiB-aligned memory advised for huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # private: shared anonymous memory is shmem, whose huge pages are a separate, usually-off switch
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP disabled in this kernel: normal pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes].view(dtype).view(shape)
