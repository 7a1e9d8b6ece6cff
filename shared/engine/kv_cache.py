"""The paged KV pool: one tensor per node.

Layout (documented contract, shared by the model, the engine and the transfer plane)::

    kv_pool[layer, kv, block, offset, kv_head, head_dim]
    shape  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

`kv` is 0 for keys and 1 for values. `kv_pool[layer]` is contiguous, so one layer's K and V for a
set of blocks is `kv_pool[layer][:, block_ids]` (shape `(2, n, block_size, heads, head_dim)`),
which is what the layer-wise KV push packs into one buffer. A token at position `p` of a sequence
with block table `bt` lives at block `bt[p // block_size]`, offset `p % block_size`; its flat slot
index inside one layer's K (or V) plane is `bt[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of K plus V for one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def describe(self) -> str:
        return (
            f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"block_size={self.block_size} dtype={self.dtype}"
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (
            self.num_layers,
            2,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )


def allocate_kv_pool(layout: KvLayout, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    return torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype, device=device)
