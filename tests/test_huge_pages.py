"""The CPU KV pool sits on transparent huge pages where the kernel offers them (madvise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.kv import huge_pages
from shared.kv.layout import KvLayout
from shared.kv.pool import allocate_kv_pool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def smaps_fields(t: torch.Tensor) -> dict[str, int]:
    """Over the mappings under `t` (/proc/self/smaps): `huge_kib`, their AnonHugePages, and
    `eligible_kib`, how much of `t` lies in mappings marked THPeligible."""
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    overlap, huge, eligible = 0, 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            overlap = max(0, min(hi, end) - max(lo, begin)) // 1024
        elif overlap and head[0] == "AnonHugePages:":
            huge += int(head[1])
        elif overlap and head[0] == "THPeligible:" and int(head[1]):
            eligible += overlap
    return {"huge_kib": huge, "eligible_kib": eligible}


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_kv_pool_on_huge_pages() -> None:
    layout = KvLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    pool = allocate_kv_pool(layout, 1024, "cpu")  # 64 MiB
    size_kib = pool.numel() * pool.element_size() // 1024
    fields = smaps_fields(pool)
    # what pdserve controls is the advice: in `madvise` mode a mapping is THP-eligible only
    # once advised. Whether the kernel then finds free 2 MiB pages depends on the machine's
    # fragmentation (a loaded host may grant none), so the backing is checked only when the
    # kernel granted any.
    assert fields["eligible_kib"] >= size_kib // 2, "the pool should be advised for huge pages"
    if fields["huge_kib"]:
        assert fields["huge_kib"] >= size_kib // 2, "the pool should be mostly 2 MiB pages"
    assert not pool.any()  # zeroed, like torch.zeros


def test_small_tensors_are_left_alone() -> None:
    small = torch.empty(1 << 20, dtype=torch.uint8)  # under one huge page: nothing to advise
    assert huge_pages.advise(small) is False
    assert huge_pages.zeros((3, 5), torch.float32).eq(0).all()
