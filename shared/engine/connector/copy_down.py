"""Copying pool blocks down to host memory on a background thread, off the step's critical path.

A published (full, hashed) block is immutable until the block manager hands it to a new owner.
So the offload tier copies it when it is released into the prefix cache's evictable set, while
later steps run; the eviction that finally reuses the block only waits for a copy still in
flight (rare: a release and its eviction are usually many steps apart).

The engine thread owns every piece of bookkeeping (which host slot a job fills, its pin, the
tier's LRU); this thread only moves bytes. On a CUDA pool it copies on its own stream, after
an event recorded when the job was submitted, so the forward's stream never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

BLOCK_DIM = 2  # the pool is [layer, plane, block, ...]
# a copy of a few blocks takes milliseconds: far past that the copier is stuck, not slow
WAIT_S = 60.0
log = logging.getLogger(__name__)


@dataclass
class CopyJob:
    blocks: list[int]  # pool blocks, in order
    slots: list[int]  # the host slots they fill
    run: Callable[[CopyJob], None] | None  # the copy, until it has run
    claim: threading.Lock = field(default_factory=threading.Lock)  # whoever runs it holds it
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0


class CopyDown:
    """One pool's copier. Its thread holds no reference to it (only to the jobs queued), so a
    discarded engine's copier is collected and its thread told to stop; at interpreter exit the
    thread is stopped before Python ends, never killed inside a copy."""

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor):
        self._pool = pool
        self._slots = slots
        self._stream = torch.cuda.Stream(pool.device) if pool.is_cuda else None
        self._queue: queue.Queue[CopyJob | None] = queue.Queue()
        thread = threading.Thread(
            target=_serve, args=(self._queue,), name="kv-copy-down", daemon=True
        )
        thread.start()
        self._stop = weakref.finalize(self, _stop, self._queue, thread)

    def submit(self, blocks: Sequence[int], slots: Sequence[int]) -> CopyJob:
        after = None
        if self._stream is not None:
            after = torch.cuda.Event()
            after.record()  # the blocks' last writer is ordered before this on the pool stream
        job = CopyJob(list(blocks), list(slots), partial(self._copy, after=after))
        self._queue.put(job)
        return job

    @staticmethod
    def finish(job: CopyJob) -> None:
        """Have the job done before returning: run here if the thread has not started it (an
        eviction right after the release should not wait for the thread's turn at the GIL),
        else wait for it."""
        if job.claim.acquire(blocking=False):
            _run(job)
        CopyDown.wait(job)

    @staticmethod
    def wait(job: CopyJob) -> None:
        if not job.done.wait(WAIT_S):
            raise RuntimeError(f"KV copy-down of blocks {job.blocks} not done in {WAIT_S:.0f}s")
        if job.error is not None:
            raise RuntimeError(f"KV copy-down of blocks {job.blocks} failed") from job.error

    def _copy(self, job: CopyJob, after: torch.cuda.Event | None) -> None:
        # on CPU, numpy's copy from each block's strided view: one thread, and the GIL let go
        # (torch's copy_ from a thread of its own starts an OpenMP team: 0.74 MB blocks copied
        # 2-4x slower, and it takes the cores the forward is using); on CUDA, a DMA each into
        # pinned memory
        if self._stream is None:
            for block, slot in zip(job.blocks, job.slots, strict=True):
                source = self._pool.select(BLOCK_DIM, block)
                np.copyto(_as_numpy(self._slots[slot]), _as_numpy(source))
            return
        assert after is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            for block, slot in zip(job.blocks, job.slots, strict=True):
                self._slots[slot].copy_(self._pool.select(BLOCK_DIM, block), non_blocking=True)
        self._stream.synchronize()

    def close(self) -> None:
        """Finish the jobs queued, then stop the thread."""
        self._stop()


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy sees it (bf16 has no numpy dtype: its bits as int16)."""
    return t.view(_SAME_SIZE[t.element_size()]).numpy()


def _serve(jobs: queue.Queue[CopyJob | None]) -> None:
    while (job := jobs.get()) is not None:
        if job.claim.acquire(blocking=False):  # else the engine thread took it
            _run(job)


def _run(job: CopyJob) -> None:
    start = time.perf_counter()
    try:
        assert job.run is not None
        job.run(job)
    except BaseException as e:  # handed to whoever waits for the job
        log.exception("KV copy-down failed")
        job.error = e
    job.run = None  # the job no longer holds the pool
    job.seconds = time.perf_counter() - start
    job.done.set()


def _stop(jobs: queue.Queue[CopyJob | None], thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join(WAIT_S)
