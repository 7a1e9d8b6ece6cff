"""Children die with their parent: a lifeline pipe from a spawning process to each node.

The parent creates a pipe per child and keeps the write end; the child inherits only the read
end (its number in PDSERVE_LIFELINE_FD) and watches it on its event loop. Nothing is ever
written: when the parent dies, however it dies (SIGKILL and the OOM killer included), the kernel
closes its descriptors, the child reads EOF and drains exactly as on SIGTERM.

Why a pipe rather than prctl(PR_SET_PDEATHSIG): the death signal fires when the parent *thread*
that forked the child exits (a node spawned from a worker thread would be killed when that
thread ends, long before the parent), it needs either a preexec_fn (unsafe in a parent with
threads: the output pumps) or a getppid() race check after exec, and it is Linux-only. A pipe's
write end belongs to the process, closes on any death, needs nothing in the fork path, and the
nodes' own sessions (kept so a terminal's Ctrl-C reaches only `pdserve up`, which stops the nodes
in order) do not matter to it. The one caveat: a process the parent *forks* without exec keeps a
copy of the write end alive; pdserve never forks (UCX does not survive a fork).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

ENV = "PDSERVE_LIFELINE_FD"

log = logging.getLogger(__name__)


class Lifeline:
    """Parent side: one pipe per child. Pass `pass_fds` and `env` to subprocess.Popen, then call
    `opened()`; `close()` after the child has exited."""

    def __init__(self) -> None:
        # os.pipe() descriptors are non-inheritable: the write end reaches no child at all, and
        # the read end only the one child that names it in pass_fds
        self.read_fd, self.write_fd = os.pipe()

    @property
    def pass_fds(self) -> tuple[int]:
        return (self.read_fd,)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(os.environ if base is None else base), ENV: str(self.read_fd)}

    def opened(self) -> None:
        """The child holds its copy of the read end now: drop ours."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def close(self) -> None:
        """Cut the line: a child still running drains and exits."""
        self.opened()
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1


def watch(loop: asyncio.AbstractEventLoop, on_parent_gone: Callable[[], None]) -> bool:
    """Child side: call `on_parent_gone` on the loop once the lifeline named by
    PDSERVE_LIFELINE_FD reads EOF. Returns False when this process was started without one."""
    value = os.environ.pop(ENV, None)  # not for our own children
    if not value:
        return False
    fd = int(value)
    os.set_inheritable(fd, False)
    os.set_blocking(fd, False)

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:  # the parent never writes; ignore anything that is not the end
            return
        loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        log.warning("parent process is gone (lifeline closed): draining and exiting")
        on_parent_gone()

    loop.add_reader(fd, readable)
    return True
