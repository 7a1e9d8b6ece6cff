"""Every request a prefill node holds anything for, from its Prefill RPC until it is released.

A job's release (wait for UCX to stop reading its blocks, then have the engine unpin and forget the
request) is a task of this table, not a step of the RPC handler: gRPC cancels the handler whenever
the caller goes away or the call's deadline passes, at whatever it awaits, and a release cut short
there left the request pinned, in DISAGG_CONTEXT_TRANS_IN_PROGRESS, until the process stopped.
A job stays here until its release is over, so its request id is refused meanwhile.

Each job also carries its deadline (the decode node's, or the call's), kept by a timer of its own
on the loop: a push not complete by then is given up (nothing more is sent, the RPC answers
DEADLINE_EXCEEDED) and released, whatever its handler is doing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import Counter

from prefill_node.job import PrefillJob

log = logging.getLogger(__name__)
T = TypeVar("T")


class JobFailed(Exception):
    """The node gave the job up before its deadline (its engine stopped)."""


class JobTable(Mapping[str, PrefillJob]):
    """request id -> job; read by the engine thread's layer hook too (plain dict reads)."""

    def __init__(self, release: Callable[[PrefillJob], Awaitable[None]], expired: Counter) -> None:
        self._jobs: dict[str, PrefillJob] = {}
        self._release_fn = release  # quiesce the push, then release the request in the engine
        self._expired = expired

    def __getitem__(self, request_id: str) -> PrefillJob:
        return self._jobs[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: PrefillJob, time_left: float) -> None:
        """Hold `job` until released; its push must be complete within `time_left` seconds."""
        assert job.request_id not in self._jobs, job.request_id
        self._jobs[job.request_id] = job
        job.time_limit = time_left
        job.expiry = asyncio.get_running_loop().call_later(time_left, self._expire, job)

    async def run(self, job: PrefillJob, work: Coroutine[Any, Any, T]) -> T:
        """The job's work (compute, push, first token) as a task of its own, so its deadline
        can stop it; raises TimeoutError if that passed first."""
        job.work = asyncio.ensure_future(work)
        try:
            return await job.work
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.given_up is not None and task is not None and not task.cancelling():
                raise job.given_up from None
            raise

    def fail_all(self, why: str) -> None:
        """The engine is gone: every job still working ends now (its RPC answers UNAVAILABLE,
        the decode node asks another node) instead of at its deadline."""
        for job in list(self._jobs.values()):
            if job.release is None and job.work is not None and not job.work.done():
                self._give_up(job, JobFailed(why))

    @staticmethod
    def _give_up(job: PrefillJob, why: Exception) -> None:
        """Nothing more is packed or sent; the job's work stops and its RPC raises `why`."""
        job.given_up = why
        job.cancelled = True
        if job.work is not None:
            job.work.cancel()

    def release(self, job: PrefillJob) -> asyncio.Future[None]:
        """Start the job's release (once); its handler awaits it shielded, so cancelling the
        RPC cannot stop it."""
        if job.release is None:
            job.release = asyncio.ensure_future(self._released(job))
        return job.release

    def cancel(self, request_id: str) -> bool:
        """The decode node gave up on `request_id` (CancelPrefill): stop computing and
        pushing it, answer its RPC, release it."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        if job.release is None:  # else it is ending already: its answer is left alone
            job.cancelled = True  # the layer hook stops packing at once
            if job.task is not None:
                job.task.cancel()
            self.release(job)
        return True

    def close(self) -> None:
        """Stop every timer and release still running (the node is stopping: its engine has
        already let every request go)."""
        for job in list(self._jobs.values()):
            job.cancelled = True
            if job.expiry is not None:
                job.expiry.cancel()
            if job.release is not None:
                job.release.cancel()
        self._jobs.clear()

    def _expire(self, job: PrefillJob) -> None:
        job.expiry = None
        if job.sent:
            return  # every KV message went out: the answer follows at once
        self._expired.inc()
        log.warning(
            "prefill %s: its KV push did not complete within its deadline (%.3gs); releasing it",
            job.request_id,
            job.time_limit,
        )
        why = f"its KV push did not complete within its deadline ({job.time_limit:.3g}s)"
        self._give_up(job, TimeoutError(why))
        self.release(job)

    async def _released(self, job: PrefillJob) -> None:
        try:
            await self._release_fn(job)
        finally:
            if job.expiry is not None:
                job.expiry.cancel()
                job.expiry = None
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]
