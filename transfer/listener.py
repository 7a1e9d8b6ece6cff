"""The decode side's UCX attachment: one worker, one bound listener, the endpoints it accepted.

The receiver never sends on accepted endpoints: it holds them (so the peers' sends can flow) and
closes them, gracefully or by force (the only way to end a matched receive whose sender stalled).
"""

from __future__ import annotations

import asyncio
import logging

from transfer.errors import TransferError, retrieve_exception
from transfer.ucp import ServerEndpoint, UcpError
from transfer.worker import UcxWorker

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0


class KvListener:
    """A UcxWorker on `loop` listening on `bind_host`:`port` (port 0: ephemeral)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bind_host: str, port: int) -> None:
        self._loop = loop
        self.worker = UcxWorker(loop)
        try:
            self._listener = self.worker.listen(
                bind_host, port, self._on_endpoint, self._on_endpoint_error
            )
        except (UcpError, ValueError) as e:
            self.worker.close()
            raise TransferError(f"cannot listen for KV on {bind_host}:{port}: {e}") from e
        self._closed = False

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

    async def reset(self) -> None:
        """Force-close every accepted endpoint: UCX fails the receives posted on them."""
        await self._close_all(force=True)

    async def close(self, force: bool) -> None:
        """Stop accepting, close the accepted endpoints (bounded wait), then the worker."""
        if self._closed:
            return
        self._closed = True
        self._listener.destroy()  # no new connections while the old ones close
        await self._close_all(force)
        self.worker.close()  # cancels whatever is still posted before the worker goes

    async def _close_all(self, force: bool) -> None:
        eps = [ep for ep in self._listener.endpoints if not ep.closing]
        closing = [self._close_endpoint(ep, force) for ep in eps]
        if closing:
            await asyncio.wait(closing, timeout=CLOSE_TIMEOUT_S)

    def _on_endpoint(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress: bookkeeping only (the listener keeps the endpoint).
        log.debug("KV sender connected from %s", endpoint.peer)

    def _on_endpoint_error(self, endpoint: ServerEndpoint) -> None:
        # Inside UCX progress too: closing an endpoint must wait for the loop.
        if not self._loop.is_closed():
            self._loop.call_soon(self._close_failed, endpoint)

    def _close_failed(self, endpoint: ServerEndpoint) -> None:
        if not self._closed and not endpoint.closing:
            self._close_endpoint(endpoint, force=True)

    def _close_endpoint(self, endpoint: ServerEndpoint, force: bool) -> asyncio.Future:
        fut = self.worker.close_endpoint(endpoint, force=force)
        fut.add_done_callback(retrieve_exception)
        fut.add_done_callback(lambda _: self._listener.forget(endpoint))
        return fut
