"""`pdserve up` keeps its nodes running: a node that exits without being asked to is started again
as it was first started, on the same ports, after a backoff, a bounded number of times a minute.

Its peers take it back by themselves: a decode node's health checks re-admit a prefill node on
its address (shared/serving/replica_pool.py), and a prefill node is told each request's KV
destination, so a restarted decode node's new KV listener needs announcing to nobody. Meanwhile
the decode node re-dispatches or prefills locally, as it does with nodes started one by one.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from pdserve.cluster import Cluster, NodeProcess

WINDOW_S = 60.0  # the restart budget counts the restarts within the last minute
# a node exits 2 when it refuses to start (a flag it cannot take, a port in use): the same
# command would refuse again, so that exit ends `up` instead of spending the restart budget
REFUSED_TO_START = 2


@dataclass(frozen=True)
class RestartPolicy:
    """`max_per_minute` restarts of one node within any minute (0: none, the first unexpected
    exit ends `up`); the n-th within a minute waits `first_backoff_s` * 2**(n-1), capped."""

    max_per_minute: int = 5
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def backoff(self, recent: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2.0**recent)


@dataclass
class _Slot:
    """One node's restart history."""

    restarts: int = 0  # since `up` started
    recent: deque[float] = field(default_factory=deque)  # when, within the window
    due: float | None = None  # a restart waits for its backoff until then
    awaiting_ready: bool = False


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    """Watches a started cluster's nodes from the thread that runs it (polling: nodes are few,
    and a tenth of a second is nothing next to a node's start-up)."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, out: TextIO = sys.stderr):
        self.cluster = cluster
        self.policy = policy
        self.out = out
        self.slots = [_Slot() for _ in cluster.nodes]

    def run(self, stopping: Callable[[], bool], poll_s: float = 0.1) -> str | None:
        """Until `stopping()` (None) or a node exits once too often (why, in words)."""
        while not stopping():
            now = time.monotonic()
            for index, slot in enumerate(self.slots):
                why = self._tick(index, slot, now)
                if why is not None:
                    return why
            time.sleep(poll_s)
        return None

    def _tick(self, index: int, slot: _Slot, now: float) -> str | None:
        node = self.cluster.nodes[index]
        if slot.due is not None:
            if now >= slot.due:
                slot.due = None
                self._restart(index, slot)
            return None
        code = node.proc.poll()
        if code is None:
            if slot.awaiting_ready and node.info:
                slot.awaiting_ready = False
                self._say(f"{_name(node)} is back (restart {slot.restarts})")
            return None
        while slot.recent and now - slot.recent[0] >= WINDOW_S:
            slot.recent.popleft()
        exited = f"{_name(node)} exited with {describe_exit(code)}"
        if code == REFUSED_TO_START:
            return f"{exited}: it refused to start (its line above says why); not restarting it"
        limit = self.policy.max_per_minute
        if len(slot.recent) >= limit:
            return f"{exited}; restarts within a minute: {len(slot.recent)}, the limit ({limit})"
        delay = self.policy.backoff(len(slot.recent))
        slot.recent.append(now)
        slot.restarts += 1
        slot.due = now + delay
        self._say(
            f"{exited}; restarting it in {delay:.1f}s "
            f"(attempt {len(slot.recent)} of {limit} this minute)"
        )
        return None

    def _restart(self, index: int, slot: _Slot) -> None:
        try:
            node = self.cluster.restart(index, slot.restarts)
        except OSError as e:  # counted as another exit at the next tick: the old one is dead
            self._say(f"{self.cluster.nodes[index].role} node did not start again: {e}")
            return
        slot.awaiting_ready = True
        self._say(f"{node.role} node restarted as pid {node.proc.pid}")

    def _say(self, line: str) -> None:
        print(f"pdserve up: {line}", file=self.out, flush=True)


def _name(node: NodeProcess) -> str:
    port = node.info.get("port")
    where = f", 127.0.0.1:{port}" if port else ""
    return f"{node.role} node (pid {node.proc.pid}{where})"
