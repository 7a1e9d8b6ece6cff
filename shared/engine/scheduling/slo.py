"""SLO-aware admission: refuse at once a request whose predicted time to first token (TTFT)
misses its target, and keep new requests out of a decode batch whose measured step time would
break the tightest inter-token latency (ITL) target of the requests in it.

TTFT prediction (engine thread, before anything is allocated): the prompt tokens ahead of the
request (queued ahead of it in the admission queue's order, admitted but not yet prefilled, local
prefills still pending) plus its own, over the prefill rate measured online. The rate is prompt
tokens per *busy* second: while at least one prefill this node started is in flight its prefill path
counts as busy, and each completion adds its tokens and the busy time since the previous completion;
the rate is the sum of the last RATE_WINDOW completions' tokens over the sum of their busy time (a
ratio of sums: first tokens often arrive together, and a rate taken per completion would count each
of those as near-infinite), of those that had the path to themselves when there are any (one
request's speed: PrefillRate says why), else of all (the path's throughput). The RPC hop and the KV
transfer are inside it (they stand between admission and the first token). When free KV blocks, not
prefill, bound the queue's drain, the requests queued ahead at the queue's measured admission rate
give the wait instead (the larger of the two is taken). With no rate sample yet nothing is refused:
there is no basis for a prediction. What this model leaves out (the prefill node's own queue, the
first token's hand-offs, prompts that join one batch on a prefill node and finish together) is
learnt online: the 90th percentile of actual minus modelled TTFT of recently admitted requests is
added to every prediction (a mean would let half of the requests admitted at their target's edge
miss it; the target is read at p90). Only errors of predictions of a similar size (within a factor
of 2) made in the last ERROR_MAX_AGE_S count: what a deep queue's batches do to its requests says
little about a request that finds the path nearly idle, and a burst's errors must not keep refusing
requests once it has drained (requests then prefilled locally, or refused, would never replace
them). The tokens ahead include the prefills in flight whole; the busy time since the last
completion, at the measured rate, is taken off them.

Step time by batch size (for the ITL bound) is measured between consecutive engine steps while
the batch was non-empty (no idle gap inside), an EWMA per batch size. Steps that carry prefill
chunks count too, so on a node that prefills its own prompts (colocated, local prefill) the
estimate is the mean gap a running request sees at that batch, the interference included. The
bound holds transfers at admission (transfer_admission.py) and prompts prefilled here at the
scheduler (they stay QUEUED, holding nothing, while the batch they would join is too slow).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared.engine.errors import ResourcesExhausted
from shared.engine.requests.request import LlmRequest, LlmRequestState
from shared.engine.scheduling.admission_queue import clamp_retry_after
from shared.engine.scheduling.service_level import ServiceLevel

S = LlmRequestState
EWMA_ALPHA = 0.2
ERROR_QUANTILE = 0.9  # of actual - modelled TTFT, added to predictions
ERRORS_KEPT = 64  # the last admitted requests' errors that quantile is taken over
ERROR_MAX_AGE_S = 20.0  # older errors describe another load
ERROR_SCALE = 2.0  # errors count for predictions within this factor of the one made
MIN_ERRORS = 3  # fewer comparable errors: none is added
RATE_WINDOW = 32  # completions the prefill rate is measured over
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
    """The `quantile` of the recent errors of comparable predictions (the module's docstring).
    `update` runs on the event loop, `value` on the engine thread: hence the lock."""

    def __init__(self, quantile: float = ERROR_QUANTILE, kept: int = ERRORS_KEPT):
        self.quantile = quantile
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=kept)  # at, modelled, e
        self._lock = threading.Lock()

    def value(self, modelled: float, now: float) -> float | None:
        """For a prediction of `modelled` seconds made at `now`; None: too few to say."""
        low, high = modelled / ERROR_SCALE, modelled * ERROR_SCALE
        with self._lock:
            errors = [
                e for at, m, e in self._samples if now - at <= ERROR_MAX_AGE_S and low <= m <= high
            ]
        if len(errors) < MIN_ERRORS:
            return None
        errors.sort()
        return errors[min(len(errors) - 1, int(self.quantile * len(errors)))]

    def update(self, error: float, modelled: float, now: float) -> None:
        with self._lock:
            self._samples.append((now, modelled, error))


@dataclass
class _InFlight:
    tokens: int
    started_at: float
    alone: bool  # started on an idle path, and nothing else started before it finished


def _rate(samples: Iterable[tuple[int, float]]) -> float | None:
    """Tokens over seconds, summed (a ratio of sums)."""
    tokens = seconds = 0.0
    for t, s in samples:
        tokens, seconds = tokens + t, seconds + s
    return tokens / seconds if seconds > 0 else None


class PrefillRate:
    """Prompt tokens per busy second of this node's prefill path (the module's docstring).
    `started` runs on the engine thread, `finished` on the event loop: hence the lock.

    A prefill that had the path to itself measures one request's speed; one among others, the
    path's throughput, which batching on the prefill node raises (prompts prefilled in one step
    share its weight reads). A prediction takes the former when there is one: after a burst the
    throughput its big steps reached would promise the next lone request a speed it cannot get,
    and a request admitted on that promise is late."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (tokens, busy s)
        self._alone: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # those alone
        self._lock = threading.Lock()
        self._inflight: OrderedDict[str, _InFlight] = OrderedDict()
        self._mark = 0.0  # the start of the busy time not yet accounted

    @property
    def tokens_per_s(self) -> float | None:
        with self._lock:
            alone = _rate(self._alone)
            return alone if alone is not None else _rate(self._samples)

    def sample(self, tokens: int, seconds: float, alone: bool = False) -> None:
        """`tokens` prefilled in `seconds` of busy time (seconds may be 0: a completion that
        came with another's); `alone`: with the path to itself."""
        with self._lock:
            self._samples.append((tokens, seconds))
            if alone:
                self._alone.append((tokens, seconds))

    def progress(self, now: float, rate: float) -> float:
        """Prompt tokens of the prefills in flight done by now at `rate` (tokens_per_s, read by
        the caller): the busy time since the last completion at that rate, at most what is in
        flight."""
        with self._lock:
            if not self._inflight:
                return 0.0
            total = sum(f.tokens for f in self._inflight.values())
            return min(float(total), (now - self._mark) * rate)

    def waiting_for_a_step(self) -> set[str]:
        """The prefills in flight that started after the path's current step did (its last
        completion, or its start from idle): those a newcomer would share a step with."""
        with self._lock:
            return {rid for rid, f in self._inflight.items() if f.started_at > self._mark}

    def started(self, rid: str, tokens: int, now: float) -> None:
        with self._lock:
            if not self._inflight:
                self._mark = now
            for other in self._inflight.values():
                other.alone = False
            self._inflight[rid] = _InFlight(tokens, now, alone=not self._inflight)
            if len(self._inflight) > _MAX_TRACKED:
                self._inflight.popitem(last=False)

    def finished(self, rid: str, now: float) -> None:
        with self._lock:
            entry = self._inflight.pop(rid, None)
            if entry is None:
                return
            elapsed, self._mark = max(0.0, now - self._mark), now
        if entry.tokens > 0:
            self.sample(entry.tokens, elapsed, entry.alone)

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
        # check_ttft runs on the engine thread, first_token and forget on the event loop
        self._lock = threading.Lock()
        self._predicted: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (with, w/o)
        self._deadlines: OrderedDict[str, float] = OrderedDict()  # admitted with a target

    def ttft_target_s(self, service: ServiceLevel) -> float | None:
        ms = service.ttft_slo_ms if service.ttft_slo_ms is not None else self.ttft_slo_ms
        return None if ms is None else ms / 1000

    def itl_target_s(self, service: ServiceLevel) -> float | None:
        ms = service.itl_slo_ms if service.itl_slo_ms is not None else self.itl_slo_ms
        return None if ms is None else ms / 1000

    def check_ttft(
        self,
        rid: str,
        tokens: int,
        ahead: int,
        service: ServiceLevel,
        wait_s: float = 0.0,
        now: float | None = None,
    ) -> float | None:
        """Raise SloMiss when `ahead + tokens` prompt tokens (less the progress of those in
        flight) at the measured rate, or a queue wait of `wait_s` then its own tokens, miss the
        target; else remember and return the prediction (seconds; None without a rate)."""
        rate = self.rate.tokens_per_s
        if rate is None:
            return None
        now = time.monotonic() if now is None else now
        left = max(0.0, ahead - self.rate.progress(now, rate))
        modelled = max((left + tokens) / rate, wait_s + tokens / rate)
        predicted = max(0.0, modelled + (self.bias.value(modelled, now) or 0.0))
        target = self.ttft_target_s(service)
        if target is not None and predicted > target:
            retry = clamp_retry_after(predicted - target)
            raise SloMiss(
                f"predicted time to first token {predicted:.2f}s exceeds the request's target "
                f"{target * 1000:g}ms ({ahead} prompt tokens ahead of its {tokens}, at "
                f"{rate:.0f} tokens/s): retry after about {retry}s, on another node, or with "
                "a longer ttft_slo_ms",
                retry,
            )
        self._check_admitted(now, now + modelled, rid)
        with self._lock:
            self._predicted[rid] = (predicted, modelled)
            if target is not None:
                self._deadlines[rid] = now + target
            for tracked in (self._predicted, self._deadlines):
                if len(tracked) > _MAX_TRACKED:
                    tracked.popitem(last=False)
        return predicted

    def _check_admitted(self, now: float, done_at: float, rid: str) -> None:
        """Raise SloMiss when the work up to this request, done at `done_at`, would end after
        the deadline of a request already admitted: prompts that reach a prefill node together
        are prefilled in one step and finish together, so the newcomer may hold back those
        ahead of it. Those already in the step under way (sent before it started) are not held
        back; the others are counted as if they all shared the newcomer's step (the pessimistic
        side). A deadline already passed protects nothing and is dropped."""
        waiting = self.rate.waiting_for_a_step()
        with self._lock:
            for gone in [r for r, d in self._deadlines.items() if d < now]:
                del self._deadlines[gone]
            held = [d for r, d in self._deadlines.items() if r in waiting]
        tightest = min(held, default=None)
        if tightest is None or done_at <= tightest:
            return
        late = done_at - tightest
        retry = clamp_retry_after(late)
        raise SloMiss(
            f"admitting request {rid} would make a request already admitted miss its time to "
            f"first token target by {late:.2f}s: retry after about {retry}s, or on another node",
            retry,
        )

    def first_token(self, rid: str, ttft: float, now: float) -> None:
        """The event loop saw the request's first token `ttft` seconds after it arrived."""
        self.rate.finished(rid, now)
        with self._lock:
            prediction = self._predicted.pop(rid, None)
            self._deadlines.pop(rid, None)
        if prediction is None:
            return
        predicted, modelled = prediction
        self.bias.update(ttft - modelled, modelled, now)
        if self.on_error is not None:
            self.on_error(predicted - ttft)

    def forget(self, rid: str) -> None:
        self.rate.drop(rid)
        with self._lock:
            self._predicted.pop(rid, None)
            self._deadlines.pop(rid, None)

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
