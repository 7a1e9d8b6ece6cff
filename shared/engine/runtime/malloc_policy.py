"""glibc malloc told to keep a step's large buffers mapped between steps.

Every forward allocates and frees the same large temporaries (the logits: 32 rows x 49,152
vocabulary x 4 bytes = 6 MiB at batch 32 on SmolLM2; a 1,024-token chunk's activations; the
attention and GEMM scratch). glibc serves a block over M_MMAP_THRESHOLD with its own mmap and
unmaps it on free, and gives the heap's free top back to the kernel past M_TRIM_THRESHOLD. Its
defaults move both with the blocks it sees freed, which on an engine's mix of sizes never settles:
the next step touches fresh pages, and each is a page fault that zeroes 4 KiB. Measured on
`bench peer`'s bf16 batch-32 engine run (SmolLM2, Zen 5, 2 threads, docs/performance.md): 378-428k
faults in one generate with the defaults, 36-39k with the thresholds below; three alternating
pairs of engine runs, 291 -> 322 tok/s mean (+10%, within a run-to-run spread of +-10%).

So an engine sets, once per process, M_MMAP_THRESHOLD to 32 MiB (the most glibc accepts: blocks
up to that size come from the heap, and a freed one is reused) and M_TRIM_THRESHOLD to 512 MiB
(freed heap is kept up to that much). Blocks larger than 32 MiB (the KV pool, a large
embedding) are still mapped on their own and given back when freed; smaller weights now come
from the heap, where they stay for the process's life anyway. The price is resident memory:
up to the largest step's working set stays mapped after the step. Nothing is changed where the
operator set glibc's malloc tunables (GLIBC_TUNABLES or MALLOC_*_ variables), where the C
library is not glibc, or with `PDSERVE_MALLOC_POLICY=0`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 512 << 20
_OPERATOR_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def operator_choice(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """Why the policy stays off in this environment, or None when it applies."""
    if environ.get("PDSERVE_MALLOC_POLICY", "1") == "0":
        return "PDSERVE_MALLOC_POLICY=0"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc tunables"
    chosen = [name for name in _OPERATOR_VARIABLES if name in environ]
    return f"{', '.join(chosen)} set" if chosen else None


@functools.cache
def apply() -> bool:
    """Set the thresholds for this process (once); whether they were set."""
    why_not = operator_choice(os.environ)
    if why_not is not None:
        log.info("malloc thresholds left as they are (%s)", why_not)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs
    except (OSError, AttributeError):
        log.info("malloc thresholds left as they are (no mallopt: not glibc)")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = ok and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    log.info(
        "malloc: blocks up to %d MiB reused from the heap, %d MiB of free heap kept (%s)",
        MMAP_THRESHOLD_BYTES >> 20,
        TRIM_THRESHOLD_BYTES >> 20,
        "set" if ok else "glibc refused",
    )
    return ok
