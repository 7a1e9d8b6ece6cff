"""`pdserve up` as one real process for several test modules (tests/support/clusters.py names
the ones shared): starting SmolLM2 on three nodes costs a model load each, so the modules that
can serve the same cluster do, and the last test that uses it stops it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tests.up_process import Up, start_up


class SharedUp:
    def __init__(self, *args: str, timeout: float = 300.0):
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        try:
            self.up: Up = start_up(self.dir, *args, timeout=timeout)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def assert_idle_and_conserved(self) -> None:
        """Between tests: `up` still runs (its supervisor restarts a node a test killed). Each
        test checks its nodes' pools through their /metrics itself: they are other processes."""
        code = self.up.proc.poll()
        assert code is None, f"pdserve up exited with {code}: {self.up.tail()}"

    def close(self) -> None:
        try:
            self.up.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
