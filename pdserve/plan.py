"""`pdserve plan`: how many prefill and decode nodes (or colocated nodes) a workload needs to meet
its TTFT and ITL targets, from a profile `pdserve bench profile` measured on the target machine.

Each tier is sized alone (the prefill nodes set the TTFT, the decode nodes the ITL: the model is
pdserve/planner_model.py, its queues simulated by planner_sim.py), each at the fewest nodes that
meet its target; colocated nodes are sized for both at once. The one with fewer nodes is
recommended; on a tie, the one with more headroom (the lower of their worst latency-to-target
ratios). Exit 0 with a recommendation, 2 when nothing within --max-nodes meets the targets (or on
bad input), with the reason.

    pdserve plan --profile profile.json --ttft-slo-ms 500 --itl-slo-ms 50 --rate 8 \\
        --prompt-len 512 --output-len 64 [--max-nodes 16] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.planner_model import (
    Targets,
    TierEstimate,
    Workload,
    colocated,
    decode_tier,
    disaggregated,
    prefill_tier,
)
from pdserve.planner_profile import Profile, ProfileError


@dataclass(frozen=True)
class Option:
    """One way to serve the workload: the fewest nodes that meet the targets, or why none do."""

    kind: str  # "disaggregated" or "colocated"
    prefill_nodes: int  # 0 for colocated
    decode_nodes: int  # colocated: the number of colocated nodes
    estimate: TierEstimate | None  # None: no count within --max-nodes meets the targets
    why_not: str = ""

    @property
    def nodes(self) -> int:
        return self.prefill_nodes + self.decode_nodes

    @property
    def feasible(self) -> bool:
        return self.estimate is not None

    def pressure(self, targets: Targets) -> float:
        """The worst of TTFT / target and ITL / target (lower: more headroom)."""
        e = self.estimate
        return math.inf if e is None else max(e.ttft_s / targets.ttft_s, e.itl_s / targets.itl_s)


@dataclass(frozen=True)
class Plan:
    workload: Workload
    targets: Targets
    max_nodes: int
    disaggregated: Option
    colocated: Option

    @property
    def recommended(self) -> Option | None:
        feasible = [o for o in (self.colocated, self.disaggregated) if o.feasible]
        return min(feasible, key=lambda o: (o.nodes, o.pressure(self.targets)), default=None)


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:.1f} ms"


def plan_disaggregated(
    profile: Profile, work: Workload, targets: Targets, max_nodes: int
) -> Option:
    """The fewest prefill nodes for the TTFT target, then the fewest decode nodes for the ITL."""

    @functools.cache  # a simulation: once per count
    def ttft(p: int) -> float:
        return prefill_tier(profile, work, targets, p)[0]

    prefill = fewest(1, max_nodes - 1, lambda p: ttft(p) <= targets.ttft_s)
    if prefill is None:
        floor = profile.prefill_s(work.prompt_len) + profile.transfer_s(work.prompt_len)
        why = (
            f"one prompt's prefill and transfer alone take {_ms(floor)}"
            if floor > targets.ttft_s
            else f"TTFT p{targets.quantile * 100:g} is {_ms(ttft(max_nodes - 1))} "
            f"even with {max_nodes - 1} prefill nodes"
        )
        return Option("disaggregated", 0, 0, None, f"{why} (target {_ms(targets.ttft_s)})")
    room = max_nodes - prefill
    decode = fewest(1, room, lambda d: decode_tier(profile, work, d)[0] <= targets.itl_s)
    if decode is None:
        return Option("disaggregated", prefill, 0, None, _itl_reason(profile, work, targets, room))
    return Option(
        "disaggregated", prefill, decode, disaggregated(profile, work, targets, prefill, decode)
    )


def _itl_reason(profile: Profile, work: Workload, targets: Targets, nodes: int) -> str:
    alone = profile.step(1, work.prompt_len + work.output_len / 2)
    if alone > targets.itl_s:
        return f"a decode step alone takes {_ms(alone)} (ITL target {_ms(targets.itl_s)})"
    return f"ITL misses {_ms(targets.itl_s)} with {nodes} decode node(s)"


def fewest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The least n in [lo, hi] with ok(n), or None; more nodes never hurt (ok is monotone), so
    by doubling from `lo`, then bisecting: each ok is a simulation, and the answer is usually
    small."""
    below, n = lo - 1, lo  # ok(below) is False (or below is out of range)
    while not ok(n):
        if n >= hi:
            return None
        below, n = n, min(hi, 2 * n)
    while n - below > 1:
        mid = (below + n) // 2
        below, n = (below, mid) if ok(mid) else (mid, n)
    return n


def plan_colocated(profile: Profile, work: Workload, targets: Targets, max_nodes: int) -> Option:
    @functools.cache
    def at(n: int) -> TierEstimate:
        return colocated(profile, work, targets, n)

    n = fewest(1, max_nodes, lambda n: at(n).meets(targets))
    if n is not None:
        return Option("colocated", 0, n, at(n))
    last = at(max_nodes)
    why = (
        f"with {max_nodes} colocated nodes: TTFT p{targets.quantile * 100:g} {_ms(last.ttft_s)} "
        f"(target {_ms(targets.ttft_s)}), ITL {_ms(last.itl_s)} (target {_ms(targets.itl_s)})"
    )
    return Option("colocated", 0, 0, None, why)


def make_plan(profile: Profile, work: Workload, targets: Targets, max_nodes: int) -> Plan:
    return Plan(
        work,
        targets,
        max_nodes,
        plan_disaggregated(profile, work, targets, max_nodes),
        plan_colocated(profile, work, targets, max_nodes),
    )


def to_json(plan: Plan) -> dict[str, Any]:
    def option(o: Option) -> dict[str, Any]:
        est = None if o.estimate is None else {k: _finite(v) for k, v in asdict(o.estimate).items()}
        return {
            "feasible": o.feasible,
            "prefill_nodes": o.prefill_nodes,
            "decode_nodes": o.decode_nodes,
            "nodes": o.nodes,
            "estimate": est,
            "why_not": o.why_not or None,
        }

    best = plan.recommended
    return {
        "workload": asdict(plan.workload),
        "targets": asdict(plan.targets),
        "max_nodes": plan.max_nodes,
        "disaggregated": option(plan.disaggregated),
        "colocated": option(plan.colocated),
        "recommendation": None if best is None else best.kind,
        "disaggregate": None if best is None else best.kind == "disaggregated",
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x  # JSON has no inf


def print_table(plan: Plan) -> None:
    w, t = plan.workload, plan.targets
    q = f"p{t.quantile * 100:g}"
    print(
        f"workload: {w.rate:g} req/s, prompt {w.prompt_len}, output {w.output_len} tokens; "
        f"targets: TTFT {q} <= {_ms(t.ttft_s)}, ITL (mean) <= {_ms(t.itl_s)}"
    )
    print(f"{'':<14} {'nodes':>7} {'TTFT ' + q:>12} {'ITL':>10} {'batch/node':>10} {'load':>5}")
    for o in (plan.disaggregated, plan.colocated):
        if o.estimate is None:
            print(f"{o.kind:<14} {'-':>7}  no configuration: {o.why_not}")
            continue
        e = o.estimate
        nodes = f"{o.prefill_nodes}P+{o.decode_nodes}D" if o.prefill_nodes else f"{o.nodes}"
        print(
            f"{o.kind:<14} {nodes:>7} {_ms(e.ttft_s):>12} {_ms(e.itl_s):>10} {e.batch:>10.1f} "
            f"{e.prefill_load:>5.2f}"
        )
    best = plan.recommended
    if best is None:
        print(f"infeasible: no configuration of at most {plan.max_nodes} nodes meets the targets")
    elif best.kind == "disaggregated":
        print(
            f"recommendation: disaggregate: {best.prefill_nodes} prefill + {best.decode_nodes} "
            f"decode node(s)" + _versus(plan.colocated)
        )
    else:
        print(
            f"recommendation: colocated: {best.nodes} node(s), no disaggregation"
            + _versus(plan.disaggregated)
        )


def _versus(other: Option) -> str:
    if not other.feasible:
        return f" ({other.kind} cannot: {other.why_not})"
    return f" ({other.kind} needs {other.nodes})"


def _check(a: argparse.Namespace) -> str | None:
    """What is wrong with the numbers given, or None."""
    positive = ("ttft_slo_ms", "itl_slo_ms", "rate", "prompt_len", "output_len", "max_nodes")
    for name in positive:
        value = getattr(a, name)
        if not (value > 0 and math.isfinite(value)):
            return f"--{name.replace('_', '-')} must be a positive number, got {value}"
    if not 0 < a.quantile < 1:
        return f"--quantile must be in (0, 1), got {a.quantile}"
    return None


def run(a: argparse.Namespace) -> int:
    problem = _check(a)
    if problem is not None:
        print(f"pdserve plan: {problem}", file=sys.stderr)
        return 2
    try:
        profile = Profile.from_dict(json.loads(a.profile.read_text()))
    except (OSError, json.JSONDecodeError, ProfileError) as e:
        print(f"pdserve plan: profile {a.profile}: {e}", file=sys.stderr)
        return 2
    work = Workload(a.rate, a.prompt_len, a.output_len)
    targets = Targets(a.ttft_slo_ms / 1e3, a.itl_slo_ms / 1e3, a.quantile)
    plan = make_plan(profile, work, targets, a.max_nodes)
    if a.json:
        print(json.dumps(to_json(plan), indent=2))
    else:
        print_table(plan)
    if plan.recommended is None:
        print(
            "pdserve plan: infeasible: no configuration meets the targets: disaggregated: "
            f"{plan.disaggregated.why_not}; colocated: {plan.colocated.why_not}",
            file=sys.stderr,
        )
        return 2
    return 0
