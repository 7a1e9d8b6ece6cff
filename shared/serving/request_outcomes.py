"""`pdserve_requests_total{outcome}`: why each request ended on a node, counted once as it ends,
from a small fixed set of labels (every series exists from the start, at 0, so that a dashboard's
rate sees the first one).

A decode (or colocated) node counts each request its check refused (`DecodeNode.validate`) or
its one request path took (`DecodeNode.generate`: a gRPC Generate call, or one prompt of an HTTP
request; its n completions together): the engine's finish reason (`stop`, `length`, `aborted`;
n > 1: the worst of its completions'), `cancelled` when its consumer went away first (the client,
or a failed sibling prompt of an HTTP batch), else the status it failed with, in lower case
(`invalid_argument`, `resource_exhausted`, ...). What the HTTP API refuses while reading the
request, before the node's check (its schema and fields, a body it cannot parse, a grammar that
does not compile), is counted too, by its status (shared/serving/http/refusals.py); a gRPC
request refused before the node's check (no prompt, a grammar) is not. A tool call is the HTTP
API's reading of a `stop`, counted as that. A prefill node counts each Prefill call: `pushed`,
`cancelled` or the status it answered.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import grpc
from prometheus_client import Counter

from shared.engine.requests.request import FinishReason
from shared.serving.grpc_server import GenerateError
from shared.serving.status import Status

CANCELLED = "cancelled"
PUSHED = "pushed"
_FAILED = tuple(s.name.lower() for s in Status)
_WORST_FIRST = (FinishReason.ABORTED, FinishReason.LENGTH, FinishReason.STOP)
DECODE_OUTCOMES = (*(r.value for r in _WORST_FIRST), CANCELLED, *_FAILED)
PREFILL_OUTCOMES = (PUSHED, CANCELLED, *_FAILED)


def failed(code: Status | grpc.StatusCode | None) -> str:
    """A failure's label: its status; a gRPC code outside `Status` (UNKNOWN: an exception the
    handler did not expect) or none is `internal`."""
    name = "INTERNAL" if code is None or code.name not in Status.__members__ else code.name
    return name.lower()


class RequestOutcomes:
    """A node's `pdserve_requests_total`, each label set up front."""

    def __init__(self, counter: Counter, outcomes: Iterable[str]) -> None:
        self.counter = counter
        for outcome in outcomes:
            counter.labels(outcome=outcome)

    def count(self, outcome: str) -> None:
        self.counter.labels(outcome=outcome).inc()

    def refused(self, error: GenerateError) -> GenerateError:
        """Count a request refused before it held anything; returns the error to raise."""
        self.count(failed(error.code))
        return error

    def ended(self, reasons: Collection[FinishReason], n: int, error: Status | None) -> None:
        """A request's end: all n completions finished (whatever the consumer did next), else
        the status it failed with, else (`error` None) its consumer went away."""
        if len(reasons) == n:
            self.count(min(reasons, key=_WORST_FIRST.index).value)
        else:
            self.count(CANCELLED if error is None else failed(error))
