"""Wire format of the layer-wise KV push (pure Python, no UCX).

One KV message is ONE tagged UCX message: a header, then the payload, in a single contiguous
buffer (so one message is one Python-level send/receive, and the receiver validates the header and
the payload from the same staging buffer before anything touches its pool)::

    offset 0   fixed header, 64 bytes, little endian (`_FIXED`):
               magic "PDKV" | version u16 | flags u16 | header_len u32 | transfer_id u64 |
               token 16s | layout fingerprint 8s | layer u32 | n_blocks u32 |
               payload_bytes u64 | reserved u32
    offset 64  n_blocks x u32 destination block ids (pool order of the payload's block axis)
    ...        zero padding up to header_len = header_size(n_blocks), a multiple of 64 so the
               payload that follows is aligned for any KV dtype
    header_len payload: kv_pool[layer][:, block_ids] as raw bytes, shape
               (2, n_blocks, block_size, kv_heads, head_dim); payload_bytes = n_blocks x
               KvLayout.block_bytes_per_layer

The UCX tag of every message of a transfer is the transfer id itself (`message_tag`): transfer ids
are random 64-bit numbers the decode node never reuses, so tags are unique per transfer, and the
receiver's UCX worker carries nothing but KV messages.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from transfer.errors import ProtocolError

MAGIC = b"PDKV"
VERSION = 1
FLAG_LAST = 0x1  # the sender's final message of the whole transfer
TOKEN_BYTES = 16
FINGERPRINT_BYTES = 8
HEADER_ALIGN = 64
MAX_U64 = (1 << 64) - 1
MAX_BLOCK_ID = (1 << 32) - 1

_FIXED = struct.Struct("<4sHHIQ16s8sIIQI")
FIXED_HEADER_BYTES = _FIXED.size  # 64
assert FIXED_HEADER_BYTES == HEADER_ALIGN

# Keys of KvReceiver.rejected_by_reason.
REJECT_UNKNOWN_TRANSFER = "unknown_transfer"  # tag or header names no live transfer
REJECT_LATE = "late"  # the transfer already completed, timed out or was cancelled
REJECT_BAD_HEADER = "bad_header"  # not a PDKV header (magic, version, structure)
REJECT_BAD_TOKEN = "bad_token"
REJECT_LAYOUT = "layout_mismatch"
REJECT_BAD_LAYER = "bad_layer"
REJECT_BAD_BLOCK = "bad_block"  # block id outside the reservation, or no blocks
REJECT_DUPLICATE = "duplicate_block"  # (layer, block) already landed, or listed twice
REJECT_BAD_LENGTH = "bad_length"  # message/payload size inconsistent with header or layout
REJECT_RECV_ERROR = "recv_error"  # UCX failed the receive (peer died mid-message)


def header_size(n_blocks: int) -> int:
    """Bytes of the header (fixed part, block ids, padding) for a message of `n_blocks`."""
    raw = FIXED_HEADER_BYTES + 4 * n_blocks
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def fingerprint_bytes(layout_fingerprint: str) -> bytes:
    """The 8 bytes of a KvLayout fingerprint carried by every message."""
    return hashlib.sha256(layout_fingerprint.encode()).digest()[:FINGERPRINT_BYTES]


def message_tag(transfer_id: int) -> int:
    """UCX tag of every message of a transfer."""
    return transfer_id


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" (or "[v6]:port") -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad transfer address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class TransferDestination:
    """Where a prefill node pushes one request's KV; created by the decode node (`expect`) and
    sent to the prefill node over gRPC."""

    address: str  # "host:port" of the decode node's UCX listener
    transfer_id: int  # unique 64-bit per transfer, never reused; the UCX tag of its messages
    token: bytes  # 16 random bytes, one-time; every KV message must carry it
    block_ids: tuple[int, ...]  # decode-side block ids to fill, in prompt order
    layout_fingerprint: str  # KvLayout.fingerprint() of the decode node

    def __post_init__(self) -> None:
        split_address(self.address)
        if not 0 <= self.transfer_id <= MAX_U64:
            raise ValueError(f"transfer_id {self.transfer_id} is not a 64-bit unsigned value")
        if len(self.token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(self.token)}")
        # gRPC hands over repeated fields as lists; keep the dataclass hashable and immutable
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "token", bytes(self.token))


@dataclass(frozen=True)
class HeaderPrefix:
    """The fixed 64 bytes of a message header, decoded."""

    transfer_id: int
    token: bytes
    layout_fingerprint: bytes
    layer: int
    n_blocks: int
    payload_bytes: int
    last: bool
    header_len: int


def encode_header(
    transfer_id: int,
    token: bytes,
    layout_fingerprint: bytes,
    layer: int,
    block_ids: tuple[int, ...] | list[int],
    payload_bytes: int,
    last: bool = False,
) -> bytes:
    """The header bytes (length header_size(len(block_ids))) of one KV message."""
    n = len(block_ids)
    size = header_size(n)
    out = bytearray(size)
    _FIXED.pack_into(
        out,
        0,
        MAGIC,
        VERSION,
        FLAG_LAST if last else 0,
        size,
        transfer_id,
        token,
        layout_fingerprint,
        layer,
        n,
        payload_bytes,
        0,
    )
    struct.pack_into(f"<{n}I", out, FIXED_HEADER_BYTES, *block_ids)
    return bytes(out)


def decode_prefix(buf: bytes | memoryview) -> HeaderPrefix:
    """Parse and structurally check the fixed header; raises ProtocolError(bad_header)."""
    if len(buf) < FIXED_HEADER_BYTES:
        raise ProtocolError(REJECT_BAD_HEADER, f"{len(buf)} bytes is shorter than a header")
    (magic, version, flags, header_len, transfer_id, token, fingerprint, layer, n, payload, _) = (
        _FIXED.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        raise ProtocolError(REJECT_BAD_HEADER, f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(REJECT_BAD_HEADER, f"unsupported version {version}")
    if header_len != header_size(n):
        raise ProtocolError(REJECT_BAD_HEADER, f"header_len {header_len} for {n} blocks")
    return HeaderPrefix(
        transfer_id=transfer_id,
        token=token,
        layout_fingerprint=fingerprint,
        layer=layer,
        n_blocks=n,
        payload_bytes=payload,
        last=bool(flags & FLAG_LAST),
        header_len=header_len,
    )


def decode_block_ids(buf: bytes | memoryview, prefix: HeaderPrefix) -> tuple[int, ...]:
    """The block ids that follow the fixed header; `buf` must hold the whole header."""
    end = FIXED_HEADER_BYTES + 4 * prefix.n_blocks
    if len(buf) < end:
        raise ProtocolError(REJECT_BAD_HEADER, f"header needs {end} bytes, have {len(buf)}")
    return struct.unpack_from(f"<{prefix.n_blocks}I", buf, FIXED_HEADER_BYTES)
