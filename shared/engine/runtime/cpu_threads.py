"""torch's and the C kernels' threads sized to the CPUs the process may use, and kept so while an
operator moves it (shared/engine/runtime/cpu_budget.py says how the count is chosen).

`apply`, once at a node's start (pdserve/cli/node_command.py), sets the count on the calling thread,
which the engine thread then borrows (shared/engine/runtime/openmp.py), and logs it in one line.
`follow`, called at every engine step on the engine thread, re-reads the budget at most once per
FOLLOW_INTERVAL_S (a syscall and a file or two); when `taskset -p`, a cpuset or a cgroup quota
changed it, the thread resizes its own team and the change is logged once. The C kernels take
torch's count on every call (the callers of shared/model/native.py pass `torch.get_num_threads()`),
so one `torch.set_num_threads` sizes both.

`taskset -p PID` without `-a` moves only the main thread. When the main thread's mask changes,
the engine thread takes it too and releases its pool: libgomp's workers keep the mask they were
created with, and a team grown while its workers stay on one core would time-slice that core.
An explicit OMP_NUM_THREADS fixes the count, and nothing is followed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

import torch

from shared.engine.runtime import openmp
from shared.engine.runtime.cpu_budget import CpuBudget, CpuBudgetReader, process_cpus

log = logging.getLogger(__name__)

FOLLOW_INTERVAL_S = 1.0

_lock = threading.Lock()
_reader: CpuBudgetReader | None = None  # set by `apply` unless the count is explicit
_budget: CpuBudget | None = None  # the latest budget logged


class _EngineThreadState(threading.local):
    next_check = 0.0  # time.monotonic() of this thread's next read
    cpus: frozenset[int] = frozenset()  # the main thread's CPUs when this thread last looked


_state = _EngineThreadState()


def apply(environ: Mapping[str, str] = os.environ) -> CpuBudget:
    """Size the calling thread's team from the budget, log it, and turn `follow` on."""
    global _reader, _budget
    reader = CpuBudgetReader()
    budget = reader.read(process_cpus(), environ)
    torch.set_num_threads(budget.threads)
    log.info("%s", budget.describe())
    with _lock:
        _budget = budget
        _reader = None if budget.override else reader
    return budget


def current() -> int:
    """The thread count of the latest budget (torch's own count before `apply`)."""
    budget = _budget
    return budget.threads if budget is not None else torch.get_num_threads()


def follow() -> None:
    """On an engine thread, between ops: follow a change of the process's CPUs (cheap when
    nothing changed or the last read was under FOLLOW_INTERVAL_S ago; no-op before `apply`)."""
    reader = _reader
    now = time.monotonic()
    if reader is None or now < _state.next_check:
        return
    _state.next_check = now + FOLLOW_INTERVAL_S
    cpus = process_cpus()
    budget = reader.read(cpus, os.environ)
    moved = False
    if cpus != _state.cpus:
        try:
            moved = _move_to(cpus)
            _state.cpus = cpus
        except OSError as e:  # a CPU went offline between the two calls: the next read retries
            log.debug("engine thread kept its CPUs (%s)", e)
    if moved or budget.threads != torch.get_num_threads():
        torch.set_num_threads(budget.threads)
        openmp.release_pool()  # the next region creates workers with this thread's mask
    _log_change(budget)


def _move_to(cpus: frozenset[int]) -> bool:
    """The calling thread onto `cpus` (the main thread's, newly changed); whether it moved. Only
    on a change of the main thread's: a thread an operator pins on its own stays pinned."""
    if frozenset(os.sched_getaffinity(0)) == cpus:
        return False
    os.sched_setaffinity(0, cpus)
    return True


def _log_change(budget: CpuBudget) -> None:
    global _budget
    with _lock:
        previous, _budget = _budget, budget
    if previous != budget:  # warning level: an operator moved a running node, say so once
        log.warning("%s", budget.describe(previous.threads if previous is not None else None))
