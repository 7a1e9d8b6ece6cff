"""The engine thread's OpenMP team, alone on the process's cores.

GNU OpenMP (libgomp.so.1, the runtime torch's CPU wheels ship) keeps one pool of worker threads
per thread that has run a parallel region. Once the pools together hold more threads than the
process has CPUs, every idle worker stops spinning after ~1,000 iterations (libgomp's throttled
spin count) and sleeps in the kernel, so each of the thousands of parallel regions of a forward
pays a futex wake-up. A node loads its model on the main thread (a pool of N threads) and then
steps the engine on a thread of its own (a second pool of N), which crosses that line whenever
N fills the cores. Measured on SmolLM2 bf16, 2 threads on 2 cores (docs/performance.md): a decode
step 35 -> 50 ms and a 256-token prefill 115 -> 190 ms on the engine thread against the same
calls on the main thread; with the main thread's pool released first, 38 and 115 ms.

So an engine thread borrows the threads of whoever starts it: `lend` (on the starting thread)
drops that thread to one torch thread and releases its pool (`omp_pause_resource_all`, OpenMP
5.0), and the engine thread sets the count the process was configured with. `give_back`, when
the last engine stops, restores the starting thread. Where torch runs another OpenMP runtime
(no libgomp loaded), nothing is released and only the thread counts move.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep what can be rebuilt cheaply

_lock = threading.Lock()
_configured: int | None = None  # the starter's torch thread count when the first engine started
_engines = 0


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded, never a second copy (RTLD_NOLOAD)."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_pool() -> bool:
    """Release the calling thread's idle OpenMP workers. True if they were released."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def lend() -> int:
    """On the thread starting an engine: the torch thread count the engine thread should set."""
    global _configured, _engines
    with _lock:
        if _engines == 0:
            _configured = torch.get_num_threads()
        _engines += 1
        if _configured > 1:
            torch.set_num_threads(1)
            if not release_pool():
                log.debug("no libgomp pool to release (another OpenMP runtime?)")
        return _configured


def engines_running() -> int:
    """Engines that borrowed threads and have not given them back."""
    with _lock:
        return _engines


def give_back() -> None:
    """On the thread stopping an engine: the last one out restores that thread's count."""
    global _engines
    with _lock:
        if _engines == 0:
            return
        _engines -= 1
        if _engines == 0 and _configured is not None:
            torch.set_num_threads(_configured)
