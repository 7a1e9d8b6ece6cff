"""Several node processes' stderr onto `pdserve up`'s one: whole lines as they come, and terminal
redraws (a progress bar's carriage-return updates, e.g. a GGUF file's loading bar) from one node
at a time. Two nodes loading at once would otherwise overwrite each other's bar on the same
terminal line, alternating every half second; here the first node to draw owns the line until
its bar ends (cleared or finished with a line, and not drawn again within HANDOVER_S: a bar
clears itself to let a line through too; or its process gone), and the other's redraws are
dropped meanwhile (its next one after that is shown). A line from anyone first clears a drawn
bar, which its owner draws again with its next update.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from typing import IO

_CLEAR_LINE = "\r\x1b[K"
HANDOVER_S = 1.0  # a bar that ended and is not drawn again within this frees the line


class StderrMux:
    def __init__(self, out: IO[str]):
        self.out = out
        self._tty = out.isatty()
        self._lock = threading.Lock()
        self._owner: str | None = None  # the node whose bar holds the line
        self._drawn = False  # the line shows a bar now
        self._ended: float | None = None  # when the owner's bar last ended (cleared, a line)

    def pump(self, label: str, fd: int) -> None:
        """Copy `fd` (a node's stderr) until it ends; `label` names the node. Closes `fd`."""
        buf, after_cr = b"", False
        try:
            while chunk := os.read(fd, 65536):
                buf, after_cr = self._segments(label, buf + chunk, after_cr)
            if buf:
                self._line(label, buf, after_cr)
        finally:
            os.close(fd)
            with self._lock:
                if self._owner == label:  # its bar will never be cleared: keep what it showed
                    self._release("\n" if self._drawn else "")

    def _segments(self, label: str, buf: bytes, after_cr: bool) -> tuple[bytes, bool]:
        """Handles every terminated segment of `buf`; returns the unterminated rest, and
        whether it follows a carriage return (it is a redraw, not a line's start)."""
        while True:
            ends = [i for i in (buf.find(b"\r"), buf.find(b"\n")) if i >= 0]
            if not ends:
                return buf, after_cr
            i = min(ends)
            segment, terminator, buf = buf[:i], buf[i : i + 1], buf[i + 1 :]
            if terminator == b"\n":
                self._line(label, segment, after_cr)
            elif segment:
                self._redraw(label, segment)
            after_cr = terminator == b"\r"

    def _line(self, label: str, segment: bytes, redrawn: bool) -> None:
        """A line; `redrawn`: it was drawn over the line's start (a bar's last state)."""
        text = segment.decode(errors="replace")
        with self._lock:
            if redrawn and self._owner == label:  # over its bar: the bar's last state and/or a
                self.out.write("\r")  # line it wrote without clearing the bar first
                self._ended = time.monotonic()
            elif self._drawn:  # a bar shows: the line goes where it was; the bar comes back
                self.out.write(_CLEAR_LINE if self._tty else "\n")
            self._drawn = False
            self.out.write(text + "\n")
            self.out.flush()

    def _redraw(self, label: str, segment: bytes) -> None:
        text = segment.decode(errors="replace")
        with self._lock:
            over = self._ended is not None and time.monotonic() - self._ended >= HANDOVER_S
            if self._owner != label and over:
                self._owner = None  # the other's bar is over
            if self._owner is None:
                self._owner, self._ended = label, None
            if self._owner != label:
                return  # another node's bar holds the line
            if not text.strip():  # the bar clears itself: it ended, or lets a line through
                self.out.write("\r" + text + "\r")
                self._drawn, self._ended = False, time.monotonic()
            else:
                self.out.write("\r" + text)
                self._drawn, self._ended = True, None
            self.out.flush()

    def _release(self, tail: str) -> None:
        self.out.write(tail)
        self.out.flush()
        self._owner, self._drawn, self._ended = None, False, None


class StderrRelay:
    """`n` pipes copied through a StderrMux onto this process's stderr by a process of their own
    (`python -m pdserve.stderr_mux DONE FD...`, detached: not a child of this one, whose
    children are its nodes): a node's lines still arrive after `pdserve up` is killed (its
    nodes drain and say so), until every node holding a pipe's other end is gone. `fds`: the
    pipes' write ends, one per node (its stderr), kept here for its restarts."""

    def __init__(self, n: int, out: int | None = None):
        """`out`: where the relay writes (a file descriptor; None: this process's stderr)."""
        pipes = [os.pipe() for _ in range(n)]
        reads = [r for r, _ in pipes]
        self.fds = [w for _, w in pipes]
        self._done, done = os.pipe()  # EOF here: the relay has copied everything and exited
        cmd = [sys.executable, "-m", __name__, str(done), *map(str, reads)]
        # its own session: a terminal's Ctrl-C is for `up`, which stops the nodes in order
        starter = subprocess.Popen(
            cmd,
            pass_fds=[done, *reads],
            stdin=subprocess.DEVNULL,
            stderr=out,
            start_new_session=True,
        )
        for fd in (done, *reads):
            os.close(fd)
        starter.wait(30)  # it forks the relay and exits at once

    def close(self, timeout: float = 10.0) -> bool:
        """Close the write ends here; wait (bounded) for the relay to copy the rest and exit.
        False: past `timeout` a node still holds its end (the relay outlives this call)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self._done], [], [], left)[0] and not os.read(self._done, 1):
                os.close(self._done)
                return True
        return False


def main(argv: list[str]) -> None:
    if os.fork() > 0:  # detach: the starter exits, the relay is nobody's child
        os._exit(0)
    done, fds = int(argv[0]), [int(fd) for fd in argv[1:]]
    mux = StderrMux(sys.stderr)
    pumps = [
        threading.Thread(target=mux.pump, args=(f"node {i}", fd), daemon=True)
        for i, fd in enumerate(fds)
    ]
    for pump in pumps:
        pump.start()
    for pump in pumps:
        pump.join()
    os.close(done)


if __name__ == "__main__":
    main(sys.argv[1:])
