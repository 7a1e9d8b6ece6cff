"""The KV pool's huge-page allocation (shared/engine/huge_pages.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from shared.engine import huge_pages
from shared.engine.kv_cache import allocate_kv_pool
from shared.model.loader import load_model


def _anon_huge_kib() -> int:
    """This process's anonymous memory on huge pages (other processes' do not count)."""
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    return int(next(ln for ln in rollup if ln.startswith("AnonHugePages")).split()[1])


def _thp_madvise() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and ("[madvise]" in path.read_text() or "[always]" in path.read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_is_a_zeroed_contiguous_tensor_on_a_huge_page_boundary(dtype: torch.dtype) -> None:
    t = huge_pages.zeros((3, 5, 1 << 17), dtype)
    assert t.shape == (3, 5, 1 << 17) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2)
    assert t.sum().item() == 2 * t.numel()


def test_small_tensors_are_plain_zeros() -> None:
    t = huge_pages.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()


@pytest.mark.skipif(not _thp_madvise(), reason="transparent huge pages are off on this kernel")
def test_the_pool_gets_huge_pages_and_gives_them_back() -> None:
    before = _anon_huge_kib()
    config = load_model("tiny").config
    pool = allocate_kv_pool(config.kv_layout(16, torch.float32), 4096, "cpu")
    pool.fill_(1.0)  # first touch: the kernel backs the pool with 2 MiB pages
    assert _anon_huge_kib() - before >= pool.numel() * 4 // 1024 // 2
    del pool
    gc.collect()
    assert _anon_huge_kib() - before < 2048  # unmapped with the tensor
