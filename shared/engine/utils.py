"""Small helpers shared by every role."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the one way pdserve turns token counts into block counts."""
    if b <= 0:
        raise ValueError(f"cdiv divisor must be positive, got {b}")
    return -(-a // b)
