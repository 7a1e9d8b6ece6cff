"""An engine thread borrows its starter's torch threads (shared/engine/runtime/openmp.py): the
starting
thread keeps one thread and no idle OpenMP pool while an engine runs, the engine thread runs with
the configured count, and the last engine to stop gives the count back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.runtime import openmp
from shared.engine.thread import EngineThread

ROOT = Path(__file__).resolve().parent.parent


def _os_threads() -> set[str]:
    """Ids of this process's OS threads (a set, not a count: a thread some other part of the
    process starts or ends meanwhile must not look like an OpenMP worker)."""
    return set(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    torch.randn(2048, 2048).mul_(2)  # large enough for torch to open a parallel region


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no pool to release")
def test_release_pool_ends_the_callers_idle_workers() -> None:
    before = torch.get_num_threads()
    result: dict[str, int | bool] = {}

    def body() -> None:  # a fresh thread: its pool is its own
        torch.set_num_threads(2)
        start = _os_threads()
        _parallel_op()
        pool = _os_threads() - start  # the workers the parallel region started
        result["with_pool"] = len(pool)
        result["released"] = openmp.release_pool()
        # libgomp's workers leave the pool before the call returns but end their OS threads
        # after it (they are detached): wait for them, up to a bound no idle worker outlives
        deadline = time.monotonic() + 5.0
        while pool & _os_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        result["after"] = len(pool & _os_threads())  # of those, still alive

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert torch.get_num_threads() == before
    if not result["released"]:
        pytest.skip("torch does not run on libgomp here")
    assert result["with_pool"] >= 1 and result["after"] == 0


@pytest.mark.parametrize("configured", [1, 2])
def test_engine_threads_borrow_and_give_back_the_threads(configured: int) -> None:
    """In a fresh interpreter: the suite's process may hold engines of its own (a shared
    cluster), which own the borrow this test counts from zero."""
    code = f"from tests.test_openmp import borrow_and_give_back; borrow_and_give_back({configured})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]


def borrow_and_give_back(configured: int) -> None:
    assert openmp.engines_running() == 0
    before = torch.get_num_threads()
    torch.set_num_threads(configured)
    loop = asyncio.new_event_loop()
    cores = [EngineCore(EngineConfig(model="tiny"), role=DecodeSettings()) for _ in range(2)]
    engines = [
        EngineThread(core, loop, lambda d: None, name=f"e{i}") for i, core in enumerate(cores)
    ]
    try:
        for engine in engines:  # two engines in one process (an in-process P/D pair)
            engine.start()
            assert torch.get_num_threads() == 1
        for engine in engines:
            seen = engine.inspect_soon(lambda _core: torch.get_num_threads()).result(timeout=30)
            assert seen == configured
        engines[0].stop()
        assert torch.get_num_threads() == 1  # the other engine still runs
        engines[1].stop()
        assert torch.get_num_threads() == configured
        engines[1].stop()  # a second stop gives back nothing more
        assert torch.get_num_threads() == configured
    finally:
        for engine in engines:
            engine.stop()
        loop.close()
        torch.set_num_threads(before)
