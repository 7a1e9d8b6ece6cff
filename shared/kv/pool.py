"""The paged KV pool's memory: one tensor per node, in the shape `KvLayout.pool_shape` gives,
on huge pages where the kernel offers them (shared/kv/huge_pages.py)."""

from __future__ import annotations

import torch

from shared.kv import huge_pages
from shared.kv.layout import KvLayout


def allocate_kv_pool(layout: KvLayout, num_blocks: int, device: torch.device | str) -> torch.Tensor:
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = layout.pool_shape(num_blocks)
    if torch.device(device).type == "cpu":  # 2 MiB pages: shared/kv/huge_pages.py
        return huge_pages.zeros(shape, layout.torch_dtype)
    return torch.zeros(shape, dtype=layout.torch_dtype, device=device)
