"""Does a listener's UCX worker still take messages off its shared-memory receive queue?

Peers on the same host deliver every message to a worker through one receive FIFO in shared
memory (UCX's sysv/posix "mm" transports), shared by all of them: a sender reserves the next
entry, writes it, then flips the entry's owner flag, and the worker consumes entries strictly in
order. A sender killed between the reservation and the flag (during the memcpy of a payload
fragment, where a large push spends most of its time) leaves an entry that never completes: the
worker waits on it for good and every other same-host peer's messages queue behind it. Nothing in
UCX times out there. Measured: a sender SIGKILLed mid-push stalled another sender's transfers
until their deadline in about 1 kill of 20 on a loaded 2-core VM (docs/performance.md).

`QueueCheck.stuck` sends one small message from a fresh worker of this process, a same-host
peer whose message crosses the same FIFO: it arrives within the timeout when, and only when, the
queue still moves. The listener runs it after each peer loss and restarts itself when stuck.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import numpy as np

from transfer import ucp_listener
from transfer.errors import retrieve_exception
from transfer.worker import UcxWorker

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 1.0


class QueueCheck:
    """Checks `worker`'s receive queue with messages of its own, random tag: a transfer's tag
    (random 64-bit too) collides with it with probability 2**-64."""

    def __init__(self, worker: UcxWorker, timeout: float) -> None:
        self._worker = worker
        self.timeout = timeout
        self.tag = secrets.randbits(64)
        self.sources: set[str] = set()  # "ip:port" of the checks' own connections
        self.checks = 0
        self._arrived: asyncio.Future[None] | None = None
        # Registered first, before the receiver's hook: the check's message never reaches it.
        worker.add_hook(self._take)

    def _take(self) -> None:
        # Probes only while a check waits (every progress round runs this hook): a check's
        # message that has not come by then never will, the worker it was sent to is closed.
        if self._arrived is None or (probe := self._worker.probe(self.tag)) is None:
            return
        received = self._worker.recv_probed(probe, np.zeros(8, dtype=np.uint8))
        received.add_done_callback(retrieve_exception)  # arriving is what counts
        if not self._arrived.done():
            self._arrived.set_result(None)

    async def stuck(self, host: str, port: int) -> bool:
        """Whether a message sent to `host`:`port` now fails to arrive within `timeout` seconds.
        A send that fails instead (the listener unreachable from this process, a configuration
        the check cannot judge) is no evidence of a stuck queue: False, logged."""
        loop = asyncio.get_running_loop()
        self.checks += 1
        self._arrived = arrived = loop.create_future()
        sender = UcxWorker(loop)
        try:
            endpoint = sender.connect(host, port)
            source = ucp_listener.local_address(endpoint.handle)
            if source is not None:  # its loss, when it closes, is not a peer's
                self.sources.add(source)
            sent = sender.send(endpoint, np.zeros(8, dtype=np.uint8), self.tag)
            sent.add_done_callback(retrieve_exception)
            both = {arrived, sent}
            await asyncio.wait(both, timeout=self.timeout, return_when=asyncio.FIRST_EXCEPTION)
            moved = arrived.done()
            if not moved and sent.done() and sent.exception() is not None:
                log.warning("KV queue check cannot reach %s:%d: %s", host, port, sent.exception())
                return False
            closing = sender.close_endpoint(endpoint)
            closing.add_done_callback(retrieve_exception)
            await asyncio.wait({closing}, timeout=_CLOSE_TIMEOUT_S)  # flushes only if it moves
            return not moved
        finally:
            self._arrived = None
            sender.close()
