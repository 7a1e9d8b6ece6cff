"""Load-back from the host KV tier against recomputing the same prompt tokens, on this machine.

Three conversations of PROMPT tokens go through a pool that holds about one and a half of them,
so the first conversation's prefix is evicted; then it returns. Timed: the returning turn's
first step (its TTFT inside the engine) with the tier on (its blocks loaded back) and off
(recomputed), and the load itself.

    python scripts/kv_offload_loadback.py --model smollm2 --prompt 1024
"""

from __future__ import annotations

import argparse
import time

from shared.engine.config import EngineConfig
from shared.engine.connector.offload import offload_tier
from shared.engine.connector.offload_config import GIB, OffloadConfig
from shared.engine.core import EngineCore
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model


def turn(core: EngineCore, prompt: list[int], rid: str) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens reused."""
    request = core.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), rid)
    start = time.perf_counter()
    while core.has_work:
        core.step()
    return time.perf_counter() - start, request.cached_tokens


def measure(
    loaded, config: EngineConfig, n: int, tier_gb: float
) -> tuple[float, int, float, float, int, float, float]:
    offload = OffloadConfig(int(tier_gb * GIB), model_id=config.model)
    core = EngineCore(config, loaded, role=DecodeSettings(offload=offload))
    vocab = core.model_config.vocab_size
    convs = [[(seed * 131 + 17 * i) % (vocab - 10) + 5 for i in range(n)] for seed in (1, 2, 3)]
    # a decode step first: the first one pays the kernels' one-time set-up, in both runs
    core.add_request(convs[2][:8], SamplingParams(max_tokens=4, ignore_eos=True), "warm")
    while core.has_work:
        core.step()
    for i, prompt in enumerate(convs):
        turn(core, prompt, f"w{i}")
    seconds, cached = turn(core, [*convs[0], 42], "back")
    # the same prompt once more: its whole prefix in the pool now (no tier involved)
    pool_hit, _ = turn(core, [*convs[0], 43], "again")
    load = copy_down = evict_wait = 0.0
    copied = 0
    tier = offload_tier(core.connector)
    if tier is not None:
        tier.check_conservation()  # the copies still in flight land first
        load, copy_down = tier.stats.load_seconds, tier.stats.offload_seconds
        evict_wait, copied = tier.stats.evict_wait_seconds, tier.stats.offloaded_blocks
    return seconds, cached, load, copy_down, copied, pool_hit, evict_wait


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    blocks = a.prompt * 3 // (2 * a.block_size)  # one and a half conversations
    config = EngineConfig(
        model=a.model, block_size=a.block_size, num_kv_blocks=blocks, max_num_tokens=8192
    )
    loaded = load_model(a.model, *_device(config))
    off = measure(loaded, config, a.prompt, 0.0)
    on = measure(loaded, config, a.prompt, 1.0)
    print(f"recompute: TTFT {off[0] * 1e3:.1f} ms, {off[1]} of {a.prompt + 1} tokens reused")
    print(
        f"load-back: TTFT {on[0] * 1e3:.1f} ms, {on[1]} of {a.prompt + 1} tokens reused, "
        f"load {on[2] * 1e3:.1f} ms; copying {on[4]} released blocks down took "
        f"{on[3] * 1e3:.1f} ms in all, in the background; the evictions waited "
        f"{on[6] * 1e3:.1f} ms"
    )
    print(f"pool hit (the same prefix still in the pool): TTFT {off[5] * 1e3:.1f} ms")


def _device(config: EngineConfig) -> tuple:
    from shared.model.device import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    return device, resolve_dtype(config.dtype, device)


if __name__ == "__main__":
    main()
