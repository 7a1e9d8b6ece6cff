"""The process that grammar compile workers are forked from.

Importing xgrammar takes seconds and ~180 MB (it imports torch and transformers), so a node pays
it once, in this process, started as `python -m shared.engine.sampling.grammar_zygote FD ENTRY`
on the first compile. Asked over its control socket, it forks a worker (ENTRY: the function
grammar_worker.worker_main) and hands the node the worker's pid and one end of a socket pair to
it (SCM_RIGHTS). A fork shares the imported pages; what a worker allocates is its own and returns
when it exits. Not multiprocessing's forkserver: its children re-import the node's __main__
module first (the whole `pdserve` command), or fail when that has no `__main__` guard.

It exits when the node closes the control socket (the node is gone); workers exit when the
node closes theirs (or, mid-compile, are killed by it).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

START_TIMEOUT_S = 120.0  # importing xgrammar on a loaded machine
log = logging.getLogger(__name__)


class Zygote:
    """The node's side: starts the zygote on first use, forks workers from it; each worker runs
    `entry` ("module:function", given its Connection to the node)."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        self._lock = threading.Lock()

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its pid and a connection to it (blocking: the first call waits for the
        zygote to import xgrammar)."""
        with self._lock:
            ctl = self._ensure()
            ctl.sendall(b"f")
            msg, fds, _, _ = socket.recv_fds(ctl, 32, 1)
            if not msg or not fds:
                self._stop()
                raise RuntimeError("the grammar compile zygote exited")
            return int(msg.decode()), Connection(fds[0])

    @property
    def up(self) -> bool:
        """Started and answering: forking a worker takes milliseconds."""
        return self._ctl is not None

    def warm(self) -> None:
        """Start the zygote in the background, if it is not up (the first compile then waits
        less: the node imports xgrammar meanwhile too)."""
        if self._ctl is not None or self._lock.locked():
            return

        def start() -> None:
            with self._lock:
                try:
                    self._ensure()
                except (OSError, RuntimeError) as e:  # the next fork() tries again and says why
                    log.warning("grammar compile zygote: %s", e)

        threading.Thread(target=start, name="grammar-zygote", daemon=True).start()

    def _ensure(self) -> socket.socket:
        if self._ctl is not None and self._proc is not None and self._proc.poll() is None:
            return self._ctl
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", __name__, str(theirs.fileno()), self.entry]
        self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        ours.settimeout(START_TIMEOUT_S)
        ready = ours.recv(1)  # b"r" once xgrammar is imported; b"" if it died
        ours.settimeout(None)
        if ready != b"r":
            ours.close()
            self._proc.wait()
            raise RuntimeError(f"the grammar compile zygote exited with {self._proc.returncode}")
        self._ctl = ours
        return ours

    def _stop(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._proc is not None:
            self._proc.wait(10)
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def main(fd: int, entry: str) -> None:
    """Serve forks on control socket `fd`; a worker runs `entry` ("module:function", given a
    Connection), named rather than imported here: the workers' module imports this one."""
    os.nice(19)  # its import (seconds of CPU) and its forks yield to the node's engine
    import xgrammar  # noqa: F401  (the point: imported once, shared by every fork)

    module, _, function = entry.partition(":")
    worker_main = getattr(importlib.import_module(module), function)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    ctl = socket.socket(fileno=fd)
    ctl.sendall(b"r")
    while ctl.recv(1) == b"f":
        here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the worker
            ctl.close()
            here.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                worker_main(Connection(there.detach()))
            finally:
                os._exit(0)
        there.close()
        socket.send_fds(ctl, [str(pid).encode()], [here.fileno()])
        here.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
