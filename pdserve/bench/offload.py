"""KV offload on multi-turn conversations: time to first token with the host tier on and off.

    pdserve bench offload [--model smollm2] [--quick] [--out bench_out]

Several conversations take turns (turn 1 of each, then turn 2 of each, ...); each turn's prompt
is the conversation so far (earlier prompts and the model's own answers) plus a new user
message. The device pool holds a fraction (`--pool-share`) of all the histories together, so by
the time a conversation comes back its prefix was evicted by the others: without offload it is
recomputed, with `--kv-offload-cpu-gb` it is loaded back from host memory. Both engines load the
same weights and take the same requests one at a time, alternating request by request so that
drift on a noisy machine falls on both; their greedy answers must be equal (the tier never
changes output). Reports the prefix hit rate (prompt tokens served from the pool or a tier) and
TTFT p50 over the turns after the first, and their ratio. Writes JSON and a PNG to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.support.util import bar_plot, environment, load_average, write_json
from shared.engine.config import EngineConfig
from shared.engine.connector.offload import offload_tier
from shared.engine.connector.offload_config import GIB, OffloadConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams

# the user messages: slices of this package's own sources (no download; varied code and prose)
CORPUS = "\n".join(p.read_text() for p in sorted(Path(__file__).parent.glob("*.py")))


@dataclass
class Turn:
    """One request's outcome on one engine."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: list[int]


@dataclass
class Workload:
    conversations: int
    turns: int
    turn_tokens: int
    answer_tokens: int


def user_messages(core: EngineCore, w: Workload) -> list[list[list[int]]]:
    """[conversation][turn]: `turn_tokens` tokens of the corpus each, every one different."""
    ids = core.tokenizer.encode(CORPUS)
    need = w.conversations * w.turns * w.turn_tokens
    ids = (ids * (need // max(1, len(ids)) + 1))[:need]
    chunks = [ids[i : i + w.turn_tokens] for i in range(0, need, w.turn_tokens)]
    return [chunks[c * w.turns : (c + 1) * w.turns] for c in range(w.conversations)]


def run_one(core: EngineCore, prompt: list[int], answer_tokens: int, rid: str) -> Turn:
    """One request alone on the engine: its TTFT, prefix hit and greedy answer."""
    params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    start = time.perf_counter()
    request = core.add_request(prompt, params, rid)
    first = 0.0
    answer: list[int] = []
    while core.has_work:
        for delta in core.step():
            first = first or time.perf_counter() - start
            answer.extend(delta.token_ids)
    core.check_conservation()
    return Turn(first, len(prompt), request.cached_tokens, answer)


def converse(engines: dict[str, EngineCore], w: Workload) -> dict[str, list[list[Turn]]]:
    """Every conversation's turns on every engine, turn-major, alternating engines per request."""
    messages = user_messages(next(iter(engines.values())), w)
    history: dict[str, list[list[int]]] = {n: [[] for _ in messages] for n in engines}
    turns: dict[str, list[list[Turn]]] = {n: [[] for _ in range(w.turns)] for n in engines}
    with tqdm(total=w.turns * w.conversations, desc="turns", unit="turn") as bar:
        for t in range(w.turns):
            for c, conversation in enumerate(messages):
                for name, core in engines.items():
                    prompt = history[name][c] + conversation[t]
                    turn = run_one(core, prompt, w.answer_tokens, f"{name}-c{c}-t{t}")
                    history[name][c] = prompt + turn.answer
                    turns[name][t].append(turn)
                bar.update()
    return turns


def summary(turns: list[list[Turn]]) -> dict[str, float]:
    later = [x for turn in turns[1:] for x in turn]  # turn 1 has no history to reuse
    every = [x for turn in turns for x in turn]
    return {
        "ttft_p50_s": statistics.median(x.ttft_s for x in later),
        "ttft_p50_first_turn_s": statistics.median(x.ttft_s for x in turns[0]),
        "prefix_hit_rate": sum(x.cached_tokens for x in later)
        / sum(x.prompt_tokens for x in later),
        "prompt_tokens": sum(x.prompt_tokens for x in every),
        "cached_tokens": sum(x.cached_tokens for x in every),
    }


def tier_stats(core: EngineCore) -> dict[str, float]:
    """What the host tier did, once the copies still in flight have landed."""
    tier = offload_tier(core.connector)
    if tier is None:
        raise ValueError("the engine has no offload tier")
    tier.check_conservation()
    s = tier.stats
    return {
        "copied_blocks": s.offloaded_blocks,
        "copy_down_s": s.offload_seconds,
        "evict_wait_s": s.evict_wait_seconds,
        "loaded_blocks": s.loaded_blocks,
        "load_s": s.load_seconds,
    }


def pool_blocks(w: Workload, share: float, block_size: int) -> tuple[int, int]:
    """(pool blocks, total history tokens): the pool holds `share` of all histories, and at
    least the longest prompt with its answer."""
    longest = w.turns * (w.turn_tokens + w.answer_tokens)
    total = w.conversations * longest
    blocks = max(int(total * share) // block_size, longest // block_size + 2)
    return blocks, total


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quick", action="store_true", help="tiny model, short turns (CI smoke)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=256, help="tokens of each user message")
    p.add_argument("--answer-tokens", type=int, default=16, help="max_tokens of each answer")
    p.add_argument("--pool-share", type=float, default=0.25, help="pool / all histories")
    p.add_argument("--cpu-gb", type=float, default=1.0, help="host tier (--kv-offload-cpu-gb)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    a = parse_args(argv)
    model = "tiny" if a.quick else a.model
    w = (
        Workload(3, 3, 48, 4)
        if a.quick
        else Workload(a.conversations, a.turns, a.turn_tokens, a.answer_tokens)
    )
    blocks, total = pool_blocks(w, a.pool_share, a.block_size)
    base = EngineConfig(
        model=model, block_size=a.block_size, num_kv_blocks=blocks, max_batch_size=1
    )
    tier = OffloadConfig(int(a.cpu_gb * GIB), model_id=model)
    engines = {
        "off": EngineCore(base, role=DecodeSettings()),
        "on": EngineCore(base, role=DecodeSettings(offload=tier)),
    }
    turns = converse(engines, w)
    tier = tier_stats(engines["on"])
    answers = {n: [[x.answer for x in turn] for turn in got] for n, got in turns.items()}
    rows = {n: summary(got) for n, got in turns.items()}
    ratio = rows["on"]["ttft_p50_s"] / rows["off"]["ttft_p50_s"]
    tqdm.write(
        f"TTFT p50 (turns 2+): off {rows['off']['ttft_p50_s'] * 1e3:.1f} ms, on "
        f"{rows['on']['ttft_p50_s'] * 1e3:.1f} ms, ratio {ratio:.2f}x; prefix hits off "
        f"{rows['off']['prefix_hit_rate']:.0%}, on {rows['on']['prefix_hit_rate']:.0%}"
    )
    tqdm.write(
        f"copy-down: {tier['copied_blocks']} blocks, {tier['copy_down_s'] * 1e3:.1f} ms in the "
        f"background; evictions waited {tier['evict_wait_s'] * 1e3:.1f} ms in all"
    )
    result = {
        "benchmark": "offload_multi_turn",
        "model": model,
        "workload": {**w.__dict__, "history_tokens": total, "pool_tokens": blocks * a.block_size},
        "host_tier_gb": a.cpu_gb,
        "outputs_equal": answers["off"] == answers["on"],
        "environment": {**environment(), "load_average": load_average(), "cpus": os.cpu_count()},
        "off": rows["off"],
        "on": rows["on"],
        "ttft_ratio": ratio,
        "tier": tier,
    }
    write_json(a.out / "offload.json", result)
    bar_plot(
        a.out / "offload.png",
        "Multi-turn TTFT p50 (turns 2+): host-memory KV tier on vs off",
        ["TTFT p50"],
        {name: [rows[name]["ttft_p50_s"] * 1e3] for name in ("off", "on")},
        "ms",
    )
    return result


if __name__ == "__main__":
    main()
