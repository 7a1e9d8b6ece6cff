"""Wire format of the layer-wise KV push (pure Python, no UCX).

One KV message (the blocks of one prefill chunk for one layer, or for a run of consecutive layers
when the sender has several ready) is TWO tagged UCX messages from the same sender, posted back to
back:

1. the header, tag = transfer id (`message_tag`)::

    offset 0   fixed header, 64 bytes, little endian (`_FIXED`):
               magic "PDKV" | version u16 | flags u16 | header_len u32 | transfer_id u64 |
               token 16s | layout fingerprint 8s | layer u16 | n_layers u16 | n_blocks u32 |
               payload_bytes u64 | seq u32
    offset 64  n_blocks x u32 destination block ids (pool order of the payload's block axis)
    then       u64 sender instance id, when flags has FLAG_INSTANCE
    then       i64 the request's mRoPE position delta, when flags has FLAG_MROPE
    ...        zero padding up to header_len = header_size(n_blocks, instance)

2. the payload, tag = `payload_tag(token, transfer_id, seq)`: exactly payload_bytes of raw KV,
   kv_pool[layer : layer + n_layers][:, :, block_ids] in the layout (n_layers, planes, n_blocks,
   block_size, kv_heads, head_dim) (planes: 2, K and V; 1, a latent pool), payload_bytes =
   n_layers x n_blocks x KvLayout.block_bytes_per_layer.

Why two: the receiver lands the payload straight in the pool blocks the header names (one UCX
receive scattered over those blocks, no staging copy), so it must have validated the header
first. The payload's tag is a MAC of the one-time token: only the holder of the token can
address a payload to a transfer, so the payload carries the token's proof without carrying
bytes the receiver would have to stage. `seq` numbers a transfer's messages (0, 1, ...); each
seq is used once, so each payload tag is too.

Transfer ids are random 64-bit numbers the decode node never reuses, so header tags are unique
per transfer, and the receiver's UCX worker carries nothing but KV messages.

The instance id: each node process draws one at start (ModelInfo.instance_id). The decode node
grants a transfer's blocks to one prefill instance (`TransferDestination.sender_instance`); that
instance stamps its id in every header (FLAG_INSTANCE) and the receiver drops a header stamped
with any other id, so nothing a restarted node's predecessor sent, nor a replay of it, lands in
blocks granted to its successor. A destination naming no instance (0) gets unstamped headers,
which is what a decode node that predates instance ids reads.

The mRoPE delta (Qwen2-VL family): how far the positions of the tokens after the prompt sit
from their indices, once the prompt's images took fewer positions than tokens. The decode node
writes it at the request's seat, so it travels with the KV it belongs to, under the same token;
every message of a push carries the same value, and a push without it (FLAG_MROPE clear) means
delta 0, which is what a text prompt has and what a decode node that predates it reads.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.errors import ProtocolError

if TYPE_CHECKING:  # the wire format itself needs no torch
    from shared.kv.layout import KvLayout

MAGIC = b"PDKV"
VERSION = 2
FLAG_LAST = 0x1  # the sender's final message of the whole transfer
FLAG_INSTANCE = 0x2  # the sender's instance id (u64) follows the block ids
FLAG_MROPE = 0x4  # the request's mRoPE delta (i64) follows the block ids and instance id
TOKEN_BYTES = 16
FINGERPRINT_BYTES = 8
HEADER_ALIGN = 64
MAX_U64 = (1 << 64) - 1
MAX_BLOCK_ID = (1 << 32) - 1
MIN_I64, MAX_I64 = -(1 << 63), (1 << 63) - 1

_FIXED = struct.Struct("<4sHHIQ16s8sHHIQI")
MAX_LAYERS = (1 << 16) - 1
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
REJECT_BAD_SEQ = "bad_seq"  # a message number used twice, or too far ahead
REJECT_STALE_INSTANCE = "stale_instance"  # stamped by another instance than the one granted
REJECT_BAD_DELTA = "bad_mrope_delta"  # a push's messages disagree on the request's mRoPE delta
MAX_SEQ = (1 << 32) - 1
# Rejections of a message that does not carry the transfer's token, or comes from another
# instance than the one its blocks were granted to: noise (forged, misrouted, replayed, a dead
# predecessor's), dropped without failing the transfer. Every other rejection blames its sender.
NOISE_REASONS = frozenset(
    {REJECT_BAD_HEADER, REJECT_UNKNOWN_TRANSFER, REJECT_BAD_TOKEN, REJECT_STALE_INSTANCE}
)


def header_size(n_blocks: int, instance: bool = False, mrope: bool = False) -> int:
    """Bytes of the header (fixed part, block ids, instance id if stamped, mRoPE delta if
    carried, padding) for a message of `n_blocks`."""
    raw = FIXED_HEADER_BYTES + 4 * n_blocks + (8 if instance else 0) + (8 if mrope else 0)
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def fingerprint_bytes(layout_fingerprint: str) -> bytes:
    """The 8 bytes of a KvLayout fingerprint carried by every message."""
    return hashlib.sha256(layout_fingerprint.encode()).digest()[:FINGERPRINT_BYTES]


def message_tag(transfer_id: int) -> int:
    """UCX tag of every header message of a transfer."""
    return transfer_id


def payload_tag(token: bytes, transfer_id: int, seq: int) -> int:
    """UCX tag of the payload that follows header `seq` of a transfer (a MAC of the token)."""
    msg = b"pdkv-payload" + transfer_id.to_bytes(8, "little") + seq.to_bytes(4, "little")
    return int.from_bytes(hmac.digest(token, msg, "sha256")[:8], "little")


def split_address(address: str) -> tuple[str, int]:
    """ "host:port" (or "[v6]:port") -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad transfer address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) -> "host:port", an IPv6 literal bracketed (split_address's inverse)."""
    bracket = ":" in host and not host.startswith("[")
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"


def resolve_bind_address(host: str) -> tuple[int, bytes]:
    """(family, packed IP) of the address to bind, for an IP literal or a resolvable name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"cannot resolve UCX bind address {host!r}: {e}") from e
        family, *_, sockaddr = infos[0]
        ip = ipaddress.ip_address(sockaddr[0])
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return family, ip.packed


def pack_sockaddr(family: int, packed_ip: bytes, port: int) -> bytes:
    """A struct sockaddr_in / sockaddr_in6 (what a UCP listener binds to)."""
    if family == socket.AF_INET:
        return struct.pack("=H", family) + struct.pack("!H", port) + packed_ip + bytes(8)
    return struct.pack("=H", family) + struct.pack("!HI", port, 0) + packed_ip + bytes(4)


def parse_sockaddr(raw: bytes) -> tuple[str, int]:
    """(ip, port) of a struct sockaddr_storage."""
    (family,) = struct.unpack_from("=H", raw, 0)
    (port,) = struct.unpack_from("!H", raw, 2)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    return f"<family {family}>", port


@dataclass(frozen=True)
class TransferDestination:
    """Where a prefill node pushes one request's KV; created by the decode node (`expect`) and
    sent to the prefill node over gRPC."""

    address: str  # "host:port" of the decode node's UCX listener
    transfer_id: int  # unique 64-bit per transfer, never reused; the UCX tag of its messages
    token: bytes  # 16 random bytes, one-time; every KV message must carry it
    block_ids: tuple[int, ...]  # decode-side block ids to fill, in prompt order
    layout_fingerprint: str  # KvLayout.fingerprint() of the decode node
    # per layer, how many of block_ids (from the first) that layer does not send: positions
    # out of its sliding window before the decode node's first query (shared/engine/
    # kv_window.py); empty: every layer sends every block
    skipped: tuple[int, ...] = ()
    # the prefill instance these blocks are granted to (it stamps every header; 0: none named)
    sender_instance: int = 0
    # the decode node's instance: a sender's endpoint cached for another one is stale
    receiver_instance: int = 0

    def __post_init__(self) -> None:
        split_address(self.address)
        for name in ("transfer_id", "sender_instance", "receiver_instance"):
            if not 0 <= getattr(self, name) <= MAX_U64:
                raise ValueError(f"{name} {getattr(self, name)} is not a 64-bit unsigned value")
        if len(self.token) != TOKEN_BYTES:
            raise ValueError(f"token must be {TOKEN_BYTES} bytes, got {len(self.token)}")
        # gRPC hands over repeated fields as lists; keep the dataclass hashable and immutable
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "token", bytes(self.token))
        object.__setattr__(self, "skipped", tuple(int(n) for n in self.skipped))


@dataclass(frozen=True)
class HeaderPrefix:
    """The fixed 64 bytes of a message header, decoded."""

    transfer_id: int
    token: bytes
    layout_fingerprint: bytes
    layer: int
    n_layers: int
    n_blocks: int
    payload_bytes: int
    last: bool
    header_len: int
    seq: int
    stamped: bool = False  # FLAG_INSTANCE: the sender's instance id follows the block ids
    has_mrope: bool = False  # FLAG_MROPE: the request's mRoPE delta follows


def encode_header(
    transfer_id: int,
    token: bytes,
    layout_fingerprint: bytes,
    layer: int,
    block_ids: tuple[int, ...] | list[int],
    payload_bytes: int,
    last: bool = False,
    seq: int = 0,
    n_layers: int = 1,
    instance_id: int = 0,
    mrope_delta: int = 0,
) -> bytes:
    """The header bytes (length header_size(len(block_ids), stamped, carried)) of one KV
    message; stamped with `instance_id` unless it is 0, carrying `mrope_delta` unless it is 0."""
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq {seq} is not a 32-bit unsigned value")
    if not (0 <= layer <= MAX_LAYERS and 1 <= n_layers <= MAX_LAYERS):
        raise ValueError(f"layers {layer}+{n_layers} do not fit the header's u16 fields")
    if not 0 <= instance_id <= MAX_U64:
        raise ValueError(f"instance id {instance_id} is not a 64-bit unsigned value")
    if not MIN_I64 <= mrope_delta <= MAX_I64:
        raise ValueError(f"mRoPE delta {mrope_delta} is not a 64-bit signed value")
    n = len(block_ids)
    size = header_size(n, instance_id != 0, mrope_delta != 0)
    flags = (FLAG_LAST if last else 0) | (FLAG_INSTANCE if instance_id else 0)
    out = bytearray(size)
    _FIXED.pack_into(
        out,
        0,
        MAGIC,
        VERSION,
        flags | (FLAG_MROPE if mrope_delta else 0),
        size,
        transfer_id,
        token,
        layout_fingerprint,
        layer,
        n_layers,
        n,
        payload_bytes,
        seq,
    )
    struct.pack_into(f"<{n}I", out, FIXED_HEADER_BYTES, *block_ids)
    tail = FIXED_HEADER_BYTES + 4 * n
    if instance_id:
        struct.pack_into("<Q", out, tail, instance_id)
        tail += 8
    if mrope_delta:
        struct.pack_into("<q", out, tail, mrope_delta)
    return bytes(out)


def decode_prefix(buf: bytes | memoryview) -> HeaderPrefix:
    """Parse and structurally check the fixed header; raises ProtocolError(bad_header)."""
    if len(buf) < FIXED_HEADER_BYTES:
        raise ProtocolError(REJECT_BAD_HEADER, f"{len(buf)} bytes is shorter than a header")
    fields = _FIXED.unpack_from(buf, 0)
    (magic, version, flags, header_len, transfer_id, token, fingerprint, layer) = fields[:8]
    n_layers, n, payload, seq = fields[8:]
    if magic != MAGIC:
        raise ProtocolError(REJECT_BAD_HEADER, f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(REJECT_BAD_HEADER, f"unsupported version {version}")
    if header_len != header_size(n, bool(flags & FLAG_INSTANCE), bool(flags & FLAG_MROPE)):
        raise ProtocolError(REJECT_BAD_HEADER, f"header_len {header_len} for {n} blocks")
    return HeaderPrefix(
        transfer_id=transfer_id,
        token=token,
        layout_fingerprint=fingerprint,
        layer=layer,
        n_layers=n_layers,
        n_blocks=n,
        payload_bytes=payload,
        last=bool(flags & FLAG_LAST),
        header_len=header_len,
        seq=seq,
        stamped=bool(flags & FLAG_INSTANCE),
        has_mrope=bool(flags & FLAG_MROPE),
    )


def decode_block_ids(buf: bytes | memoryview, prefix: HeaderPrefix) -> tuple[int, ...]:
    """The block ids that follow the fixed header; `buf` must hold the whole header."""
    end = FIXED_HEADER_BYTES + 4 * prefix.n_blocks
    if len(buf) < end:
        raise ProtocolError(REJECT_BAD_HEADER, f"header needs {end} bytes, have {len(buf)}")
    return struct.unpack_from(f"<{prefix.n_blocks}I", buf, FIXED_HEADER_BYTES)


def decode_instance(buf: bytes | memoryview, prefix: HeaderPrefix) -> int:
    """The sender's instance id stamped in the header (0: not stamped)."""
    if not prefix.stamped:
        return 0
    at = FIXED_HEADER_BYTES + 4 * prefix.n_blocks
    if len(buf) < at + 8:
        raise ProtocolError(REJECT_BAD_HEADER, f"header needs {at + 8} bytes, have {len(buf)}")
    (instance_id,) = struct.unpack_from("<Q", buf, at)
    return instance_id


def decode_mrope_delta(buf: bytes | memoryview, prefix: HeaderPrefix) -> int:
    """The request's mRoPE delta the header carries (0: none carried)."""
    if not prefix.has_mrope:
        return 0
    at = FIXED_HEADER_BYTES + 4 * prefix.n_blocks + (8 if prefix.stamped else 0)
    if len(buf) < at + 8:
        raise ProtocolError(REJECT_BAD_HEADER, f"header needs {at + 8} bytes, have {len(buf)}")
    (delta,) = struct.unpack_from("<q", buf, at)
    return delta


def validate_header(
    head: bytes,
    *,
    transfer_id: int,
    token: bytes,
    layout: KvLayout,
    fingerprint: bytes,
    max_blocks: int,
    instance_id: int = 0,
) -> tuple[HeaderPrefix, tuple[int, ...]]:
    """Check one whole header message against the transfer its tag names (granted to sender
    instance `instance_id`, 0: none named), and return it decoded with its block ids. Pure: no
    I/O, no transfer state (claims and seqs are the landing's). Raises ProtocolError; a reason
    in NOISE_REASONS means the message lacks the token or comes from another instance."""
    prefix = decode_prefix(head)
    if prefix.transfer_id != transfer_id:
        raise ProtocolError(REJECT_UNKNOWN_TRANSFER, "header/tag mismatch")
    if not hmac.compare_digest(prefix.token, token):
        raise ProtocolError(REJECT_BAD_TOKEN)
    stamped = decode_instance(head, prefix)
    if stamped != instance_id:
        raise ProtocolError(
            REJECT_STALE_INSTANCE, f"sent by instance {stamped:#x}, granted to {instance_id:#x}"
        )
    if prefix.layout_fingerprint != fingerprint:
        raise ProtocolError(REJECT_LAYOUT)
    if not (prefix.n_layers >= 1 and prefix.layer + prefix.n_layers <= layout.num_layers):
        raise ProtocolError(REJECT_BAD_LAYER, f"layers {prefix.layer}..+{prefix.n_layers}")
    if not 0 < prefix.n_blocks <= max_blocks:
        raise ProtocolError(REJECT_BAD_BLOCK, f"{prefix.n_blocks} blocks")
    if len(head) != prefix.header_len:
        raise ProtocolError(
            REJECT_BAD_LENGTH,
            f"header message {len(head)} B, header_len says {prefix.header_len} B",
        )
    expected = layout.payload_bytes(prefix.n_layers, prefix.n_blocks)
    if prefix.payload_bytes != expected:
        raise ProtocolError(
            REJECT_BAD_LENGTH,
            f"header says {prefix.payload_bytes} B payload, {prefix.n_layers} layers of "
            f"{prefix.n_blocks} blocks need {expected} B",
        )
    return prefix, decode_block_ids(head, prefix)
