"""One transfer's landing on the decode node: what it reserved, what headers claimed, what has
landed, its seq window and its write fence.

Fences: once a payload receive into the pool is posted, UCX writes those blocks until the receive
completes, and a matched receive cannot be cancelled (`ucp_request_cancel` ignores it). A transfer
that fails or is cancelled while payloads are being written therefore stays fenced (`writing` > 0)
until its last write has ended; only then may its blocks go to anyone else. `KvReceiver.release`
waits for the fence and, after a timeout (a sender stalled mid-payload), force-closes the
endpoints, which makes UCX fail the posted receives. CUDA pools receive into a staging buffer;
the fence covers it the same way.

Bookkeeping only: no torch, no UCX, no event loop calls. The receiver (`transfer.receiver`) does
the I/O and asks the landing what each message means; the futures and the deadline timer it
resolves live here so that one object is one transfer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer import protocol
from transfer.errors import ProtocolError

log = logging.getLogger(__name__)

SEQ_WINDOW = 64  # payload tags registered ahead of the highest header seq seen: senders keep
# fewer messages than this in flight per transfer


@dataclass
class TransferStats:
    """What landed for one transfer; times are time.monotonic()."""

    transfer_id: int
    request_id: str
    num_blocks: int
    num_layers: int
    expected_at: float
    skipped_pairs: int = 0  # (layer, block) pairs the sender was told to leave out
    bytes: int = 0  # payload bytes written into the pool
    messages: int = 0  # accepted messages (header + payload)
    first_message_at: float | None = None
    last_message_at: float | None = None
    layer_completed_at: list[float | None] = field(default_factory=list)
    completed_at: float | None = None
    # the request's mRoPE delta its sender's headers carried (0: none carried)
    mrope_delta: int = 0


class LandingState(enum.Enum):
    LIVE = "live"
    COMPLETE = "complete"
    FAILED = "failed"


class Progress(enum.Enum):
    """What one landed payload did to its transfer."""

    MORE = "more"  # pairs still missing
    COMPLETE = "complete"  # every (layer, block) pair has landed
    SHORT = "short"  # the sender's last message came with pairs missing


@dataclass(eq=False, slots=True)
class Announced:
    """A validated header: what its payload must be and where it lands."""

    layer: int
    n_layers: int
    ids: tuple[int, ...]
    nbytes: int
    last: bool

    @property
    def layers(self) -> range:
        return range(self.layer, self.layer + self.n_layers)


def check_reservation(ids: tuple[int, ...], num_blocks: int) -> None:
    """Raise ValueError unless `ids` are distinct blocks of a pool of `num_blocks`."""
    if not ids:
        raise ValueError("a transfer needs at least one block")
    if len(set(ids)) != len(ids):
        raise ValueError("block_ids contain duplicates")
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} outside the pool's {num_blocks} blocks")


class Landing:
    """The state of one transfer, from `KvReceiver.expect` until its result is collected."""

    def __init__(
        self,
        transfer_id: int,
        request_id: str,
        token: bytes,
        block_ids: tuple[int, ...],
        num_layers: int,
        now: float,
        on_layer: Callable[[int], None] | None,
        done: asyncio.Future[TransferStats],
        quiesced: asyncio.Future[None],
        skipped: tuple[int, ...] = (),
        instance: int = 0,
    ) -> None:
        self.transfer_id = transfer_id
        self.instance = instance  # the sender instance granted the blocks (0: unstamped)
        self.request_id = request_id
        self.token = token
        self.block_ids = block_ids
        self.num_layers = num_layers
        self.on_layer = on_layer
        self.done = done
        self.quiesced = quiesced  # no write into the pool (or staging) is posted any more
        self.max_header = protocol.header_size(len(block_ids), instance != 0, mrope=True)
        self.state = LandingState.LIVE
        self.deadline: asyncio.TimerHandle | None = None  # set by the receiver's `wait`
        self.writing = 0  # payload receives posted and not completed: the fence
        self.stats = TransferStats(
            transfer_id=transfer_id,
            request_id=request_id,
            num_blocks=len(block_ids),
            num_layers=num_layers,
            expected_at=now,
            layer_completed_at=[None] * num_layers,
        )
        self._position = {b: i for i, b in enumerate(block_ids)}  # block id -> index
        self._claimed = [bytearray(len(block_ids)) for _ in range(num_layers)]
        self._layer_missing = [len(block_ids)] * num_layers
        self.missing = len(block_ids) * num_layers
        for layer, n in enumerate(skipped):  # never sent: claimed up front, so one that comes
            self._claimed[layer][:n] = bytes([1]) * n  # anyway is a duplicate
            self._layer_missing[layer] -= n
            self.missing -= n
            self.stats.skipped_pairs += n
        self.tags: dict[int, int] = {}  # registered payload tag -> seq
        self.window_end = 0  # payload tags are registered for seq < window_end
        self._seen: set[int] = set()  # seqs of validated headers
        self._announced: dict[int, Announced] = {}  # seq -> header awaiting its payload
        self.early: dict[int, object] = {}  # seq -> payload probe that came before its header
        self._next_layer_callback = 0
        self._delta_from: int | None = None  # the seq of the first header, which set the delta

    @property
    def live(self) -> bool:
        return self.state is LandingState.LIVE

    @property
    def total_pairs(self) -> int:
        return len(self.block_ids) * self.num_layers

    # ---- headers and claims -------------------------------------------------------------------
    def check_claims(self, prefix: protocol.HeaderPrefix, ids: tuple[int, ...]) -> Announced:
        """What a structurally valid header announces, if its seq is fresh and its blocks are
        reserved here and not yet claimed for its layers; raises ProtocolError otherwise."""
        if prefix.seq in self._seen or prefix.seq >= self.window_end:
            raise ProtocolError(
                protocol.REJECT_BAD_SEQ, f"seq {prefix.seq} (window ends at {self.window_end})"
            )
        layers = range(prefix.layer, prefix.layer + prefix.n_layers)
        listed: set[int] = set()
        for b in ids:
            pos = self._position.get(b)
            if pos is None:
                raise ProtocolError(protocol.REJECT_BAD_BLOCK, f"block {b} is not reserved")
            if b in listed:
                raise ProtocolError(protocol.REJECT_DUPLICATE, f"block {b} listed twice")
            listed.add(b)
            for layer in layers:
                if self._claimed[layer][pos]:
                    raise ProtocolError(protocol.REJECT_DUPLICATE, f"layer {layer} block {b}")
        return Announced(prefix.layer, prefix.n_layers, ids, prefix.payload_bytes, prefix.last)

    def check_delta(self, seq: int, delta: int) -> None:
        """Every message of a push carries the same mRoPE delta (the first sets it); raises
        ProtocolError(bad_mrope_delta) otherwise."""
        if self._delta_from is None:
            self._delta_from, self.stats.mrope_delta = seq, delta
        elif delta != self.stats.mrope_delta:
            raise ProtocolError(
                protocol.REJECT_BAD_DELTA,
                f"message {seq} carries mRoPE delta {delta}, message {self._delta_from} "
                f"carried {self.stats.mrope_delta}",
            )

    def claim(self, seq: int, announced: Announced) -> None:
        """Record a validated header: its (layer, block) pairs are taken, its payload awaited."""
        for layer in announced.layers:
            claimed = self._claimed[layer]
            for b in announced.ids:
                claimed[self._position[b]] = 1
        self._seen.add(seq)
        self._announced[seq] = announced

    def extend_window(self, end: int) -> list[tuple[int, int]]:
        """Open payload seqs up to `end` (exclusive); returns the new (tag, seq) pairs."""
        end = min(end, protocol.MAX_SEQ + 1)
        new = [
            (protocol.payload_tag(self.token, self.transfer_id, seq), seq)
            for seq in range(self.window_end, end)
        ]
        self.tags.update(new)
        self.window_end = max(self.window_end, end)
        return new

    # ---- payloads -----------------------------------------------------------------------------
    def take_announced(self, seq: int) -> Announced | None:
        """The header a payload of `seq` belongs to, once (None: not validated yet)."""
        return self._announced.pop(seq, None)

    def is_repeat(self, seq: int) -> bool:
        """Whether a payload for `seq` was already seen (landed or waiting for its header)."""
        return seq in self._seen or seq in self.early

    def account(self, a: Announced, now: float) -> Progress:
        """Count a payload that landed in its blocks."""
        stats = self.stats
        stats.bytes += a.nbytes
        stats.messages += 1
        stats.first_message_at = stats.first_message_at or now
        stats.last_message_at = now
        for layer in a.layers:
            self._layer_missing[layer] -= len(a.ids)
            if self._layer_missing[layer] == 0:
                stats.layer_completed_at[layer] = now
        self.missing -= len(a.ids) * a.n_layers
        if self.missing == 0:
            return Progress.COMPLETE
        return Progress.SHORT if a.last else Progress.MORE

    def fire_layer_callbacks(self) -> None:
        """Call `on_layer` for each layer whose blocks have all landed, once each, in order."""
        while (
            self.state is not LandingState.FAILED
            and self._next_layer_callback < self.num_layers
            and self._layer_missing[self._next_layer_callback] == 0
        ):
            layer = self._next_layer_callback
            self._next_layer_callback += 1
            if self.on_layer is None:
                continue
            try:
                self.on_layer(layer)
            except Exception:  # a caller's bug must not break the receiver
                log.exception("on_layer(%d) of transfer %#x raised", layer, self.transfer_id)

    def arm_deadline(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        on_deadline: Callable[[Landing, float], None],
    ) -> None:
        """Fail by `on_deadline(self, timeout)` in `timeout` s, unless an earlier one is set."""
        when = loop.time() + max(0.0, timeout)
        if self.deadline is not None and self.deadline.when() <= when:
            return
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = loop.call_at(when, self._expire, on_deadline, timeout)

    def _expire(self, on_deadline: Callable[[Landing, float], None], timeout: float) -> None:
        self.deadline = None
        on_deadline(self, timeout)

    # ---- end ----------------------------------------------------------------------------------
    def finish(self, state: LandingState) -> dict[int, object]:
        """Leave LIVE; returns the early payload probes, which the receiver must drain."""
        self.state = state
        early, self.early = self.early, {}
        self._announced.clear()
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        return early

    def short_message(self) -> str:
        return (
            f"transfer {self.transfer_id:#x}: sender's last message arrived with "
            f"{self.missing} (layer, block) pairs missing"
        )

    def timeout_message(self, timeout: float) -> str:
        return (
            f"transfer {self.transfer_id:#x} ({self.request_id}) timed out after {timeout:.3g}s: "
            f"{self.missing} of {self.total_pairs} (layer, block) pairs missing, "
            f"{self.stats.messages} messages landed"
        )
