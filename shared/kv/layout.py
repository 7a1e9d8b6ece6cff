"""The paged KV pool: one tensor per node.

Layout (documented contract, shared by the model, the engine and the transfer plane)::

    kv_pool[layer, kv, block, offset, kv_head, head_dim]
    shape  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

`kv` is 0 for keys and 1 for values. A latent layout (multi-head latent attention, DeepSeek-V2/V3)
has one plane instead of two, `kv_pool[layer, 0, block, offset, 0]` holding a token's compressed
latent and rotated rope key (`kv_lora_rank + qk_rope_head_dim` values): `planes=1`, one "head" of
that width. Every byte offset below follows from `planes`, so the transfer plane moves a latent
pool's blocks as it moves K/V ones. `kv_pool[layer]` is contiguous, so one layer's K and V for a
set of blocks is `kv_pool[layer][:, block_ids]` (shape `(2, n, block_size, heads, head_dim)`),
which is what the layer-wise KV push packs into one buffer. A token at position `p` of a sequence
with block table `bt` lives at block `bt[p // block_size]`, offset `p % block_size`; its flat slot
index inside one layer's K (or V) plane is `bt[p // block_size] * block_size + p % block_size`.

This module is the only place that turns the layout into byte offsets: the transfer plane builds
its UCX iov lists from `KvLayout.block_spans`. It sits below the model, the engine and the transfer
plane, which all write or move what it describes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


@dataclass(frozen=True)
class KvLayout:
    """What two nodes must agree on before one writes KV into the other's pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # one of _DTYPES' keys
    # 2: a K and a V plane per layer; 1: one latent plane (multi-head latent attention)
    planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")
        dtype_from_name(self.dtype)
        if self.planes not in (1, 2):
            raise ValueError(
                f"KvLayout.planes must be 1 (latent) or 2 (K and V), got {self.planes}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K plus V (or of the latent) for one block in one layer."""
        return self.planes * self.plane_block_bytes

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of K (or V) for one block in one layer: one contiguous run in the pool."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies over every layer: what sizes the pool per token."""
        return self.payload_bytes(self.num_layers, 1) // self.block_size

    def payload_bytes(self, n_layers: int, n_blocks: int) -> int:
        """Bytes of `n_blocks` blocks' K and V (or latent) over `n_layers` layers."""
        return n_layers * n_blocks * self.block_bytes_per_layer

    def payload_shape(self, n_layers: int, n_blocks: int) -> tuple[int, ...]:
        """Shape of kv_pool[layer : layer + n_layers][:, :, block_ids] (a KV message's payload)."""
        return (n_layers, self.planes, n_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_stride_bytes(self, num_blocks: int) -> int:
        """Bytes from one layer's K plane to the next layer's, in a pool of `num_blocks`."""
        return self.planes * num_blocks * self.plane_block_bytes

    def block_spans(
        self,
        num_blocks: int,
        layer: int,
        n_layers: int,
        block_ids: Sequence[int],
        merge: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, lengths), int64 byte arrays relative to the start of a contiguous pool of
        `num_blocks` blocks, covering kv_pool[layer : layer + n_layers][:, :, block_ids] in
        payload order (per layer: K blocks, then V blocks); with `merge` a run of adjacent ids
        is one span, without it every block is its own. Vectorised: no Python loop per block."""
        if not (layer >= 0 and n_layers >= 1 and layer + n_layers <= self.num_layers):
            raise ValueError(f"layers {layer}..+{n_layers} outside 0..{self.num_layers - 1}")
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= num_blocks:
            raise ValueError(f"block ids must be non-empty and inside 0..{num_blocks - 1}")
        block = self.plane_block_bytes
        kv_stride = num_blocks * block
        layer_stride = self.layer_stride_bytes(num_blocks)
        if merge:
            starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
        else:
            starts = np.arange(ids.size)
        run_lengths = np.diff(np.concatenate((starts, [ids.size]))) * block
        run_offsets = ids[starts] * block
        # (n_layers, planes, runs): layer-major, then K/V, then the runs in payload order
        planes = (layer + np.arange(n_layers))[:, None] * layer_stride + (
            np.arange(self.planes) * kv_stride
        )
        offsets = planes[:, :, None] + run_offsets[None, None, :]
        lengths = np.broadcast_to(run_lengths, offsets.shape)
        return offsets.reshape(-1), np.ascontiguousarray(lengths).reshape(-1)

    def check_pool(self, kv_pool: torch.Tensor) -> None:
        """Raise ValueError unless `kv_pool` is a contiguous pool of this layout."""
        if kv_pool.dim() != 6 or tuple(kv_pool.shape) != self.pool_shape(kv_pool.shape[2]):
            raise ValueError(
                f"kv_pool shape {tuple(kv_pool.shape)} does not match layout {self.describe()}"
            )
        if kv_pool.dtype != self.torch_dtype:
            raise ValueError(f"kv_pool dtype {kv_pool.dtype} does not match layout {self.dtype}")
        if not kv_pool.is_contiguous():
            raise ValueError("kv_pool must be contiguous")

    def describe(self) -> str:
        latent = " latent" if self.planes == 1 else ""  # K/V layouts keep their fingerprints
        return (
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"block_size={self.block_size} dtype={self.dtype}{latent}"
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (
            self.num_layers,
            self.planes,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
