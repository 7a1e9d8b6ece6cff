"""What the HTTP API refuses itself, counted in the node's `pdserve_requests_total{outcome}`: a
400 (its schema and fields, a body it cannot parse, a grammar that does not compile) as
`invalid_argument`, a 429 (no grammar compile worker free) as `resource_exhausted`. Refusals by
the node's own check reach the API as GenerateError and were counted by the node: not again here.
"""

from __future__ import annotations

from typing import Any

from shared.serving.request_outcomes import RequestOutcomes

OUTCOME_BY_STATUS = {400: "invalid_argument", 429: "resource_exhausted"}


def outcomes_of(backend: object) -> RequestOutcomes | None:
    """The HTTP API's backend's outcomes, where it has them (a decode node)."""
    outcomes = getattr(backend, "outcomes", None)
    return outcomes if isinstance(outcomes, RequestOutcomes) else None


def count_refusal(app: Any, status: int) -> None:
    outcome = OUTCOME_BY_STATUS.get(status)
    outcomes = getattr(getattr(app, "state", None), "outcomes", None)
    if outcome is not None and outcomes is not None:
        outcomes.count(outcome)
