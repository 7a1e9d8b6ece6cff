"""KV blocks on local disk below the host tier, one file per block, kept across restarts.

A file is `<key hex>.kv`: a header (magic, the block's key, payload length, a BLAKE2b digest of
the payload) then the block's bytes. A read checks all four: a truncated, corrupted or foreign
(another key's, another format's) file is counted, deleted and reported missing, so the block is
recomputed, never served. Writes run on one background thread from bytes already copied out of
host memory, bounded in bytes queued; a full disk or an unwritable directory is logged once per
cause and the block is simply not kept (the request that needs it later recomputes it).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
HEADER = struct.Struct("<8s32sQ16s")  # magic, key, payload bytes, blake2b-128 of payload
SUFFIX = ".kv"
MAX_QUEUED_BYTES = 256 << 20  # writes waiting for the disk; past it a block is not kept


@dataclass
class DiskStats:
    written_blocks: int = 0
    written_bytes: int = 0
    write_errors: int = 0
    write_dropped: int = 0  # queue full: the disk is slower than evictions
    invalid_blocks: int = 0  # truncated, corrupted or foreign files found at read


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskTier:
    def __init__(
        self, directory: str, capacity_bytes: int, block_bytes: int, stats: DiskStats | None = None
    ):
        self.dir = Path(directory)
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity = capacity_bytes // self.file_bytes
        self.stats = DiskStats() if stats is None else stats
        self._lock = threading.Lock()  # the index: the engine thread reads, the writer adds
        self._index: OrderedDict[bytes, None] = OrderedDict()  # keys on disk, oldest first
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._queued_bytes = 0
        self._logged: set[str] = set()
        self._flushed = threading.Event()
        self.usable = self._open()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        if self.usable:
            self._writer.start()

    def _open(self) -> bool:
        """Index what a previous run left (oldest first by mtime); False: no disk tier."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
            for stale in self.dir.glob("*.tmp"):  # a write a stop cut short
                stale.unlink(missing_ok=True)
            found = [(p.stat().st_mtime, p) for p in self.dir.glob(f"*{SUFFIX}")]
        except OSError as e:
            log.error(
                "KV disk tier %s unusable (%s): evicted KV is recomputed instead", self.dir, e
            )
            return False
        for _, path in sorted(found):
            try:
                self._index[bytes.fromhex(path.stem)] = None
            except ValueError:
                continue  # not one of ours
        log.info("KV disk tier %s: %d blocks from before", self.dir, len(self._index))
        return True

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    # ---- reads (engine thread) ------------------------------------------------------------
    def read(self, key: bytes) -> bytes | None:
        """The block's verified bytes, or None (missing or invalid: counted and removed)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(key)
            return None
        problem = self._check(key, data)
        if problem is None:
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            return data[HEADER.size :]
        self.stats.invalid_blocks += 1
        log.warning("KV disk tier: %s %s: recomputed instead", path.name, problem)
        self._forget(key)
        path.unlink(missing_ok=True)
        return None

    def _check(self, key: bytes, data: bytes) -> str | None:
        if len(data) < HEADER.size:
            return "is truncated (no header)"
        magic, stored_key, length, digest = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "is not a KV block file"
        if stored_key != key:
            return "holds another block's key"
        if length != self.block_bytes or len(data) != HEADER.size + length:
            return f"is truncated or the wrong size ({len(data) - HEADER.size} of {length} bytes)"
        if _digest(memoryview(data)[HEADER.size :]) != digest:
            return "fails its checksum"
        return None

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._index.pop(key, None)

    # ---- writes (background thread) -------------------------------------------------------
    def write(self, key: bytes, payload: bytes) -> None:
        """Queue `payload` (a copy: the caller's memory may change) for disk."""
        if not self.usable or key in self:
            return
        with self._lock:
            if self._queued_bytes + len(payload) > MAX_QUEUED_BYTES:
                self.stats.write_dropped += 1
                return
            self._queued_bytes += len(payload)
        self._queue.put((key, payload))

    def write_by(self, key: bytes, payload: bytes, deadline: float) -> bool:
        """`write`, waiting for room in the queue instead of dropping, until `deadline`
        (time.monotonic()); False: the deadline passed first."""
        while True:
            with self._lock:
                room = self._queued_bytes + len(payload) <= MAX_QUEUED_BYTES
            if room:
                self.write(key, payload)
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.flush(left)
            except TimeoutError:
                return False

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (at most `timeout` seconds) until the queued writes are on disk."""
        if not self.usable:
            return
        done = self._flushed = threading.Event()
        self._queue.put(None)
        if not done.wait(timeout):
            raise TimeoutError(f"KV disk tier writes still queued after {timeout}s")

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._flushed.set()
                continue
            key, payload = item
            self._write_one(key, payload)
            with self._lock:
                self._queued_bytes -= len(payload)

    def _write_one(self, key: bytes, payload: bytes) -> None:
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        header = HEADER.pack(MAGIC, key, len(payload), _digest(payload))
        try:
            self._make_room()
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # atomic: a crash leaves a .tmp, never a half block file
        except OSError as e:
            self.stats.write_errors += 1
            tmp.unlink(missing_ok=True)
            cause = "full" if e.errno == errno.ENOSPC else "unwritable"
            if cause not in self._logged:
                self._logged.add(cause)
                log.error(
                    "KV disk tier %s is %s (%s): blocks it cannot keep are recomputed",
                    self.dir,
                    cause,
                    e,
                )
            return
        with self._lock:
            self._index[key] = None
        self.stats.written_blocks += 1
        self.stats.written_bytes += len(payload)

    def _make_room(self) -> None:
        """LRU within --kv-offload-disk-gb: the oldest files go first."""
        while True:
            with self._lock:
                if len(self._index) < self.capacity or not self._index:
                    return
                old, _ = self._index.popitem(last=False)
            self._path(old).unlink(missing_ok=True)
