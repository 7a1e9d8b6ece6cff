"""transfer.send_cost: the fixed cost and bandwidth fitted from completed sends."""

from __future__ import annotations

import pytest

from transfer.send_cost import MIN_SAMPLES, TARGET_EFFICIENCY, SendCost


def _feed(cost: SendCost, fixed: float, bandwidth: float, sizes: list[int]) -> None:
    now = 0.0
    for n in sizes:
        took = fixed + n / bandwidth
        cost.observe(n, now, now + took)
        now += took + 1.0  # idle between messages: each is charged its own time only


def test_fits_fixed_cost_and_bandwidth() -> None:
    cost = SendCost()
    assert cost.min_message_bytes == 0  # nothing measured yet
    _feed(cost, 200e-6, 5e9, [32 << 10, 2 << 20, 256 << 10, 8 << 20] * 4)
    assert cost.fixed_s == pytest.approx(200e-6, rel=1e-3)
    assert cost.bandwidth == pytest.approx(5e9, rel=1e-3)
    ratio = TARGET_EFFICIENCY / (1 - TARGET_EFFICIENCY)
    assert cost.min_message_bytes == pytest.approx(200e-6 * 5e9 * ratio, rel=1e-2)


def test_one_size_only_gives_no_estimate() -> None:
    cost = SendCost()
    _feed(cost, 200e-6, 5e9, [64 << 10] * (4 * MIN_SAMPLES))
    assert cost.min_message_bytes == 0


def test_queued_messages_are_charged_their_service_time() -> None:
    """Posted together, the second waits for the first: its time starts at the first's end."""
    cost = SendCost()
    fixed, bw, now = 100e-6, 1e9, 0.0
    for _ in range(MIN_SAMPLES * 2):
        small, big = 4096, 4 << 20
        first = now + fixed + small / bw
        second = first + fixed + big / bw
        cost.observe(small, now, first)
        cost.observe(big, now, second)  # posted at `now`, started when the first completed
        now = second + 1.0
    assert cost.fixed_s == pytest.approx(fixed, rel=1e-3)
    assert cost.bandwidth == pytest.approx(bw, rel=1e-3)
