"""One in-process cluster for several tests: it lives on its own event-loop thread (gRPC's aio
servers belong to the loop they started on, and each test runs its own), each test runs its
scenario there with `run`, and the cluster is stopped once the last test that asks for it is done.

A test that shares a cluster asserts conservation after its scenario (every seat and KV block
back in its pool); the fixture checks it again before the next test gets the cluster."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tests.support.cluster import PdCluster


class LoopThread:
    """An event loop running on its own thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the scenario stops where it is instead of running on
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class SharedCluster:
    """`pd_cluster(model, **options)` started once on a LoopThread."""

    def __init__(self, model: str | Path, *, start_timeout: float = 300.0, **options: Any):
        from tests.support.cluster import pd_cluster  # torch and the nodes: only when one starts

        self.runner = LoopThread()
        self._scope = pd_cluster(model, **options)
        try:
            self.cluster: PdCluster = self.runner.run(self._scope.__aenter__(), start_timeout)
        except BaseException:
            self.runner.close()
            raise

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        """`coro` on the cluster's loop, as asyncio.run would run it on a fresh one."""
        return self.runner.run(coro, timeout)

    def assert_idle_and_conserved(self) -> None:
        self.run(self.cluster.assert_idle_and_conserved(), 60)

    def close(self) -> None:
        try:
            self.run(self._scope.__aexit__(None, None, None), 120)
        finally:
            self.runner.close()


class Shared(Protocol):
    """What a shared cluster offers the fixture: a check between tests, and a stop."""

    def assert_idle_and_conserved(self) -> None: ...

    def close(self) -> None: ...


class SharedClusters:
    """Clusters by name, each started by the first test that asks for it and stopped after the
    last one to run (`expect` counts them once collection is done; `release` after each)."""

    def __init__(self) -> None:
        self.users: dict[str, int] = {}
        self.started: dict[str, Shared] = {}

    def expect(self, name: str, users: int) -> None:
        self.users[name] = users

    def acquire(self, name: str, start: Callable[[], Shared]) -> Shared:
        if name not in self.started:
            self.started[name] = start()
        return self.started[name]

    def release(self, name: str) -> None:
        """The test is done: conservation holds before anyone else gets the cluster (a cluster
        that fails it is stopped: the next user starts a fresh one), and the last user stops it."""
        self.users[name] = self.users.get(name, 1) - 1
        if name not in self.started:
            return  # the test never got as far as starting it (skipped, a fixture failed)
        try:
            self.started[name].assert_idle_and_conserved()
        except BaseException:
            self.started.pop(name).close()
            raise
        if self.users[name] <= 0:
            self.started.pop(name).close()

    def close_all(self) -> None:
        while self.started:
            self.started.popitem()[1].close()
