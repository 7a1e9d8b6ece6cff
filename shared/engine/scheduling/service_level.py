"""A request's service level: its priority and its latency targets (TTFT, ITL).

Carried on `SamplingParams.service` so that it reaches every place that orders or admits
requests without a parameter of its own; the decode node's admission reads it
(shared/engine/scheduling/slo.py), the scheduler's preemption reads the priority.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's convention: lower value = served earlier. Bounded so that aging bounds starvation
# (shared/engine/scheduling/admission_queue.py).
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
MAX_SLO_MS = 3_600_000  # an hour: a larger target is no target


@dataclass(frozen=True)
class ServiceLevel:
    priority: int = 0
    ttft_slo_ms: float | None = None  # None: the node's --ttft-slo-ms (or no target)
    itl_slo_ms: float | None = None  # None: the node's --itl-slo-ms (or no target)

    def validate(self) -> None:
        """Raise ValueError naming the field."""
        if not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(
                f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority}"
            )
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_SLO_MS:
                raise ValueError(f"{name} must be in (0, {MAX_SLO_MS}] ms, got {value}")
