"""Every transfer a receiver knows: live ones by transfer id and by payload tag, fenced ones,
finished ones until their result is collected, and tombstones of finished ids and tags (so
their late messages are told apart from noise).

Bookkeeping only: no torch, no UCX, no event loop calls beyond creating a transfer's futures.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Callable

from transfer import protocol
from transfer.landing import SEQ_WINDOW, Landing


class Landings:
    """Every transfer a receiver knows, by transfer id and by payload tag, plus tombstones:
    ids and tags of finished transfers, so their late messages are told apart from noise."""

    def __init__(self, tombstone_ttl_s: float = 600.0, tombstone_max: int = 100_000) -> None:
        self.live: dict[int, Landing] = {}
        self.fenced: dict[int, Landing] = {}  # failed transfers with writes still posted
        self._finished: dict[int, Landing] = {}  # done, result not collected by `wait` yet
        self._payload_tags: dict[int, Landing] = {}  # registered payload tag -> its transfer
        self._dead: OrderedDict[int, float] = OrderedDict()  # ids and payload tags -> expiry
        self._ttl = tombstone_ttl_s
        self._max = tombstone_max

    def new_transfer_id(self, now: float) -> int:
        """A random nonzero 64-bit id no live, finished or remembered transfer uses."""
        self._expire(now)
        while True:
            transfer_id = secrets.randbits(64)
            taken = (
                transfer_id in self.live
                or transfer_id in self._dead
                or transfer_id in self._payload_tags
            )
            if transfer_id and not taken:
                return transfer_id

    def open(
        self,
        request_id: str,
        block_ids: tuple[int, ...],
        num_layers: int,
        on_layer: Callable[[int], None] | None,
        loop: asyncio.AbstractEventLoop,
        now: float,
        skipped: tuple[int, ...] = (),
        instance: int = 0,
    ) -> Landing:
        """A new live transfer (fresh id and token) with its first payload tags registered;
        `skipped`: per layer, how many of `block_ids` (from the first) will not be sent;
        `instance`: the sender instance its blocks are granted to (0: none named)."""
        if skipped and (
            len(skipped) != num_layers or not 0 <= min(skipped) <= max(skipped) < len(block_ids)
        ):
            raise ValueError(
                f"skipped {skipped} does not fit {num_layers} layers of {len(block_ids)} blocks"
            )
        token = secrets.token_bytes(protocol.TOKEN_BYTES)
        t = Landing(
            self.new_transfer_id(now),
            request_id,
            token,
            block_ids,
            num_layers,
            now,
            on_layer,
            done=loop.create_future(),
            quiesced=loop.create_future(),
            skipped=skipped,
            instance=instance,
        )
        self.add(t)
        return t

    def add(self, t: Landing) -> None:
        self.live[t.transfer_id] = t
        self.open_window(t, SEQ_WINDOW)

    def open_window(self, t: Landing, end: int) -> None:
        for tag, _ in t.extend_window(end):
            self._payload_tags[tag] = t

    def find(self, transfer_id: int) -> Landing | None:
        """A live transfer, or a finished one whose result was not collected."""
        return self.live.get(transfer_id) or self._finished.get(transfer_id)

    def granted_to(self, instance: int) -> list[Landing]:
        """The live transfers whose blocks are granted to sender instance `instance`."""
        return [t for t in self.live.values() if t.instance == instance]

    def payload_owner(self, tag: int) -> Landing | None:
        return self._payload_tags.get(tag)

    def is_dead(self, tag: int) -> bool:
        return tag in self._dead

    def forget_tag(self, t: Landing, tag: int, now: float) -> None:
        """A payload tag was used: later messages with it are late."""
        t.tags.pop(tag, None)
        self._payload_tags.pop(tag, None)
        self._dead[tag] = now + self._ttl

    def retire(self, t: Landing, now: float) -> None:
        """`t` left LIVE: its id and tags become tombstones, it stays fenced while it writes."""
        expiry = now + self._ttl
        for tag in t.tags:
            self._payload_tags.pop(tag, None)
            self._dead[tag] = expiry
        t.tags.clear()
        del self.live[t.transfer_id]
        self._finished[t.transfer_id] = t
        self._dead[t.transfer_id] = expiry
        if t.writing:
            self.fenced[t.transfer_id] = t
        else:
            self.unfence(t)

    def unfence(self, t: Landing) -> None:
        """No write for `t` is posted any more: its blocks may be reused."""
        self.fenced.pop(t.transfer_id, None)
        if not t.quiesced.done():
            t.quiesced.set_result(None)

    def collect(self, transfer_id: int) -> None:
        """The result was handed out (or given up): forget the transfer."""
        self._finished.pop(transfer_id, None)

    def _expire(self, now: float) -> None:
        while self._dead:
            key, expiry = next(iter(self._dead.items()))
            if expiry > now and len(self._dead) <= self._max:
                break
            self._dead.popitem(last=False)
            self._finished.pop(key, None)  # never collected: let it go
