"""The decode side's UCX attachment: one worker, one bound listener, the endpoints it accepted.

The receiver never sends on accepted endpoints: it holds them (so the peers' sends can flow) and
closes them, gracefully or by force (the only way to end a matched receive whose sender stalled).

After a peer is lost (an accepted endpoint fails: the process died or closed), a `QueueCheck`
asks whether the worker's shared-memory receive queue still moves: a peer killed mid-message can
leave it stuck for every other same-host peer (see transfer.queue_check). If it does not, the
listener restarts: `on_restart(why)` first (the owner fails what is in flight), then the old
endpoints, listener and worker go, and a new worker listens on the same address.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from transfer.errors import KvPortInUse, TransferError, retrieve_exception
from transfer.protocol import join_address
from transfer.queue_check import QueueCheck
from transfer.ucp import UcpError
from transfer.ucp_listener import ServerEndpoint
from transfer.worker import UcxWorker

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
QUEUE_CHECK_TIMEOUT_S = 2.0  # a check's message takes 20-50 ms on a loaded 2-core VM
_MAX_RECHECKS = 4  # checks in a row while more peers are lost (each check's own loss is known)
_RELISTEN_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # then every second, until it binds or closes
_UCS_ERR_BUSY = -15  # ucs_status_t of a listener whose port another socket holds


class KvListener:
    """A UcxWorker on `loop` listening on `bind_host`:`port` (port 0: ephemeral; a restart
    listens on the port first bound)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        bind_host: str,
        port: int,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self._loop = loop
        self._bind_host = bind_host
        self._on_restart = on_restart
        self._hooks: list[Callable[[], None]] = []
        self._closed = False
        self._watch: asyncio.Task[None] | None = None
        self._recheck = False
        self.restarts = 0
        self._listen(port)

    def _listen(self, port: int) -> None:
        worker = UcxWorker(self._loop)
        try:
            listener = worker.listen(self._bind_host, port, self._on_endpoint, self._on_error)
        except (UcpError, ValueError) as e:
            worker.close()
            if isinstance(e, UcpError) and e.status == _UCS_ERR_BUSY:
                raise KvPortInUse(self._bind_host, port) from e
            raise TransferError(f"cannot listen for KV on {self._bind_host}:{port}: {e}") from e
        self.worker, self._listener = worker, listener
        self.check = QueueCheck(worker, QUEUE_CHECK_TIMEOUT_S)  # its hook goes first
        for hook in self._hooks:
            worker.add_hook(hook)

    @property
    def ip(self) -> str:
        return self._listener.ip

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def num_endpoints(self) -> int:
        """Accepted endpoints not closing: one per connected prefill node, normally."""
        return sum(1 for ep in self._listener.endpoints if not ep.closing)

    def add_hook(self, hook: Callable[[], None]) -> None:
        """`UcxWorker.add_hook` on this worker and on every worker a restart makes."""
        self._hooks.append(hook)
        self.worker.add_hook(hook)

    async def reset(self) -> None:
        """Force-close every accepted endpoint: UCX fails the receives posted on them."""
        await self._close_all(force=True)

    async def close(self, force: bool) -> None:
        """Stop accepting, close the accepted endpoints (bounded wait), then the worker."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        await self._teardown(force)

    async def _teardown(self, force: bool) -> None:
        self._listener.destroy()  # no new connections while the old ones close
        await self._close_all(force)
        self.worker.close()  # cancels whatever is still posted before the worker goes

    async def _close_all(self, force: bool) -> None:
        eps = [ep for ep in self._listener.endpoints if not ep.closing]
        closing = [self._close_endpoint(ep, force) for ep in eps]
        if closing:
            await asyncio.wait(closing, timeout=CLOSE_TIMEOUT_S)

    # ---- peers --------------------------------------------------------------------------------
    def _on_endpoint(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress: bookkeeping only (the listener keeps the endpoint).
        log.debug("KV sender connected from %s", endpoint.peer)

    def _on_error(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress too: closing an endpoint must wait for the loop.
        if not self._loop.is_closed():
            self._loop.call_soon(self._peer_lost, endpoint, self.worker)

    def _peer_lost(self, endpoint: ServerEndpoint, worker: UcxWorker) -> None:
        if self._closed or worker is not self.worker:  # a restart took the endpoint with it
            return
        if not endpoint.closing:
            self._close_endpoint(endpoint, force=True)
        if endpoint.peer in self.check.sources:  # a check's own connection closing
            self.check.sources.discard(endpoint.peer)
            return
        if self._watch is not None and not self._watch.done():
            self._recheck = True  # checked again once the running check ends
            return
        self._watch = self._loop.create_task(self._check_queue())
        self._watch.add_done_callback(retrieve_exception)

    def _close_endpoint(self, endpoint: ServerEndpoint, force: bool) -> asyncio.Future:
        fut = self.worker.close_endpoint(endpoint, force=force)
        fut.add_done_callback(retrieve_exception)
        listener = self._listener
        fut.add_done_callback(lambda _: listener.forget(endpoint))
        return fut

    # ---- the receive queue after a peer loss --------------------------------------------------
    async def _check_queue(self) -> None:
        for _ in range(_MAX_RECHECKS):
            self._recheck = False
            if await self.check.stuck(_connect_host(self.ip), self.port):
                if not self._closed:
                    await self._restart()
                return
            if not self._recheck:
                return

    async def _restart(self) -> None:
        port = self.port
        why = (
            f"KV listener {join_address(self._bind_host, port)} restarted: its shared-memory "
            "receive queue stopped moving after a peer died mid-message"
        )
        log.warning("%s (no message through it in %.3gs)", why, self.check.timeout)
        self.restarts += 1
        if self._on_restart is not None:
            self._on_restart(why)  # fails transfers in flight while the old worker still exists
        await self._teardown(force=True)
        for attempt in itertools.count():
            if self._closed:
                return
            try:
                self._listen(port)
                log.info("KV listener listening again on %s", join_address(self.ip, port))
                return
            except TransferError as e:  # the port may take a moment to be free again
                delay = _RELISTEN_BACKOFF_S[min(attempt, len(_RELISTEN_BACKOFF_S) - 1)]
                log.warning("%s; again in %.3gs", e, delay)
                await asyncio.sleep(delay)


def _connect_host(bound_ip: str) -> str:
    """Where this process reaches a listener bound to `bound_ip` (any-address: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound_ip, bound_ip)
