"""SLO-aware admission: refuse at once a request whose predicted time to first token (TTFT)
misses its target, and keep new requests out of a decode batch whose measured step time would
break the tightest inter-token latency (ITL) target of the requests in it.

TTFT prediction (engine thread, before anything is allocated): the prompt tokens ahead of the
request (queued ahead of it in the admission queue's order, admitted but not yet prefilled, local
prefills still pending) plus its own, over the prefill rate measured online. The rate is an EWMA
of prompt tokens per *busy* second: while at least one prefill this node started is in flight its
prefill path counts as busy, and each completion adds its tokens over the busy time since the
previous completion. At low load that is one request's speed, at saturation the path's throughput;
the RPC hop and the KV transfer are inside it (they stand between admission and the first token).
When free KV blocks, not prefill, bound the queue's drain, the requests queued ahead at the
queue's measured admission rate give the wait instead (the larger of the two is taken). With no
rate sample yet nothing is refused: there is no basis for a prediction. What this model leaves
out (the prefill node's own queue, the first token's hand-offs) is learnt online: the 90th
percentile of actual minus modelled TTFT over the last admitted requests is added to every
prediction (a mean would let half of the requests admitted at their target's edge miss it; the
target is read at p90).

Step time by batch size (for the ITL bound) is measured between consecutive engine steps while
the batch was non-empty (no idle gap inside), an EWMA per batch size. Steps that carry prefill
chunks count too, so on a node that prefills its own prompts (colocated, local prefill) the
estimate is the mean gap a running request sees at that batch, the interference included. The
bound holds transfers at admission (transfer_admission.py) and prompts prefilled here at the
scheduler (they stay QUEUED, holding nothing, while the batch they would join is too slow).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.scheduling.admission_queue import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S
from shared.engine.scheduling.service_level import ServiceLevel

S = LlmRequestState
EWMA_ALPHA = 0.2
ERROR_QUANTILE = 0.9  # of actual - modelled TTFT, added to predictions
ERRORS_KEPT = 64  # the last admitted requests' errors that quantile is taken over
_MAX_TRACKED = 4096  # predictions and in-flight prefills remembered (oldest dropped first)
# states in which a request's prompt still stands between it and its first token
_PREFILLING = (
    S.QUEUED,
    S.CONTEXT_INIT,
    S.DISAGG_GENERATION_INIT,
    S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
)


class SloMiss(ResourcesExhausted):
    """The predicted TTFT misses the request's target: refused before anything is allocated."""


class Ewma:
    def __init__(self, alpha: float = EWMA_ALPHA):
        self.alpha = alpha
        self.value: float | None = None

    def update(self, sample: float) -> None:
        v = self.value
        self.value = sample if v is None else v + self.alpha * (sample - v)


class ErrorQuantile:
    """The `quantile` of the last `kept` samples. `update` runs on the event loop, `value` on the
    engine thread: hence the lock."""

    def __init__(self, quantile: float = ERROR_QUANTILE, kept: int = ERRORS_KEPT):
        self.quantile = quantile
        self._samples: deque[float] = deque(maxlen=kept)
        self._lock = threading.Lock()

    @property
    def value(self) -> float | None:
        with self._lock:
            ordered = sorted(self._samples)
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def update(self, sample: float) -> None:
        with self._lock:
            self._samples.append(sample)


class PrefillRate:
    """Prompt tokens per busy second of this node's prefill path (the module's docstring).
    `started` runs on the engine thread, `finished` on the event loop: hence the lock."""

    def __init__(self) -> None:
        self.ewma = Ewma()
        self._lock = threading.Lock()
        self._inflight: OrderedDict[str, int] = OrderedDict()  # request id -> prompt tokens
        self._mark = 0.0  # the start of the busy time not yet accounted

    @property
    def tokens_per_s(self) -> float | None:
        return self.ewma.value

    def started(self, rid: str, tokens: int, now: float) -> None:
        with self._lock:
            if not self._inflight:
                self._mark = now
            self._inflight[rid] = tokens
            if len(self._inflight) > _MAX_TRACKED:
                self._inflight.popitem(last=False)

    def finished(self, rid: str, now: float) -> None:
        with self._lock:
            tokens = self._inflight.pop(rid, None)
            if tokens is None:
                return
            elapsed, self._mark = now - self._mark, now
            if elapsed > 0 and tokens > 0:
                self.ewma.update(tokens / elapsed)

    def drop(self, rid: str) -> None:
        """Ended without a first token seen (cancelled, failed)."""
        with self._lock:
            self._inflight.pop(rid, None)


class StepTimes:
    """Engine step seconds by the decode tokens a step carries (one per request, several for a
    request whose step carries more), measured between consecutive steps."""

    def __init__(self) -> None:
        self.by_batch: dict[int, Ewma] = {}
        self._last: tuple[int, float, int] | None = None  # (steps, at, batch) at the last step

    def tick(self, num_steps: int, batch: int, now: float) -> None:
        """After every step or command; only step-to-step gaps over a busy engine count."""
        last = self._last
        if last is not None and num_steps == last[0]:
            return  # a command, no step: the gap runs on from the last step
        if last is not None and num_steps == last[0] + 1 and last[2] > 0:
            self.by_batch.setdefault(last[2], Ewma()).update(now - last[1])
        self._last = (num_steps, now, batch)

    def estimate(self, batch: int) -> float | None:
        """The nearest measured batch at or above `batch`, else the largest below (optimistic:
        the batch grows until a measurement says it is too slow)."""
        above = [b for b in self.by_batch if b >= batch]
        pick = min(above) if above else max(self.by_batch, default=None)
        return None if pick is None else self.by_batch[pick].value


class SloPolicy:
    """The node's defaults, its measurements and its predictions."""

    def __init__(self, ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None):
        self.ttft_slo_ms = ttft_slo_ms
        self.itl_slo_ms = itl_slo_ms
        self.rate = PrefillRate()
        self.steps = StepTimes()
        self.on_error: Callable[[float], None] | None = None  # predicted - actual TTFT, s
        self.bias = ErrorQuantile()  # actual - modelled TTFT of admitted requests, s
        self._predicted: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (with, w/o)

    def ttft_target_s(self, service: ServiceLevel) -> float | None:
        ms = service.ttft_slo_ms if service.ttft_slo_ms is not None else self.ttft_slo_ms
        return None if ms is None else ms / 1000

    def itl_target_s(self, service: ServiceLevel) -> float | None:
        ms = service.itl_slo_ms if service.itl_slo_ms is not None else self.itl_slo_ms
        return None if ms is None else ms / 1000

    def check_ttft(
        self, rid: str, tokens: int, ahead: int, service: ServiceLevel, wait_s: float = 0.0
    ) -> float | None:
        """Raise SloMiss when `ahead + tokens` prompt tokens at the measured rate (or a queue
        wait of `wait_s`, then its own tokens) miss the target; else remember and return the
        prediction (seconds; None without a rate)."""
        rate = self.rate.tokens_per_s
        if rate is None:
            return None
        modelled = max((ahead + tokens) / rate, wait_s + tokens / rate)
        predicted = max(0.0, modelled + (self.bias.value or 0.0))
        target = self.ttft_target_s(service)
        if target is not None and predicted > target:
            retry = math.ceil(predicted - target)
            retry = max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, retry))
            raise SloMiss(
                f"predicted time to first token {predicted:.2f}s exceeds the request's target "
                f"{target * 1000:.0f}ms ({ahead} prompt tokens ahead of its {tokens}, at "
                f"{rate:.0f} tokens/s): retry after about {retry}s, on another node, or with "
                "a longer ttft_slo_ms",
                retry,
            )
        self._predicted[rid] = (predicted, modelled)
        if len(self._predicted) > _MAX_TRACKED:
            self._predicted.popitem(last=False)
        return predicted

    def first_token(self, rid: str, ttft: float, now: float) -> None:
        """The event loop saw the request's first token `ttft` seconds after it arrived."""
        self.rate.finished(rid, now)
        prediction = self._predicted.pop(rid, None)
        if prediction is None:
            return
        predicted, modelled = prediction
        self.bias.update(ttft - modelled)
        if self.on_error is not None:
            self.on_error(predicted - ttft)

    def forget(self, rid: str) -> None:
        self.rate.drop(rid)
        self._predicted.pop(rid, None)

    def batch_too_slow(self, live: Iterable[LlmRequest], candidate: LlmRequest) -> bool:
        """Whether the measured step time at the batch `candidate` would make (the live
        requests past admission, plus it) exceeds the tightest ITL target among them."""
        batch = list(live)
        if not batch:
            return False  # alone it meets what it can: refusing would not speed it up
        targets = [self.itl_target_s(r.sampling_params.service) for r in (*batch, candidate)]
        tightest = min((t for t in targets if t is not None), default=None)
        if tightest is None:
            return False
        step = self.steps.estimate(step_tokens(batch) + candidate.step_tokens)
        return step is not None and step > tightest


def step_tokens(requests: Iterable[LlmRequest]) -> int:
    """Decode tokens a step carries for these requests (`LlmRequest.step_tokens` each)."""
    return sum(r.step_tokens for r in requests)


def tokens_still_to_prefill(requests: Iterable[LlmRequest]) -> int:
    """Prompt tokens still to compute for the requests among these not past their prefill."""
    total = 0
    for r in requests:
        if r.state in _PREFILLING:
            total += max(0, r.prompt_len - max(r.num_computed_tokens, r.cached_tokens))
    return total
