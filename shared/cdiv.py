"""Ceiling division, shared by every layer (block counts, kernel tiles)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the one way pdserve turns token counts into block counts."""
    if b <= 0:
        raise ValueError(f"cdiv divisor must be positive, got {b}")
    return -(-a // b)
