"""The newer model families on the GPU: per family (the tests' tiny checkpoints), fp32 greedy
tokens with CUDA graphs on and with them off, each against transformers' `generate` on CUDA.
Token-exact is the target for both; the rows land in the benchmark's summary."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3", "gemma3")
PROMPTS = {"count": 6, "vocab": 512, "max_len": 120, "tokens": 16}


def greedy_hf(model: Any, prompt: list[int], tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=0,
        )
    return out[0, len(prompt) :].tolist()


def family_tokens(path: Path, graphs: bool, prompts: list[list[int]]) -> tuple[list, int]:
    """Our fp32 greedy tokens per prompt and the decode graph's replay count."""
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.llm import LLM
    from shared.engine.sampling.sampling_params import SamplingParams
    from shared.model.loader import load_model

    config = EngineConfig(
        model=str(path), num_kv_blocks=512, device="cuda", dtype="float32", cuda_graphs=graphs
    )
    llm = LLM(config, load_model(str(path), torch.device("cuda"), torch.float32))
    outs = llm.generate(prompts, SamplingParams(max_tokens=PROMPTS["tokens"]))
    runner = llm.core.decode_runner
    llm.core.check_conservation()
    return [o.token_ids for o in outs], runner.num_replays if runner is not None else 0


def one_family(arch: str, root: Path) -> dict[str, Any]:
    import random

    from tests.support.checkpoints import cached_checkpoint, load_hf_model

    path = cached_checkpoint(root, arch)
    rng = random.Random(90)
    prompts = [
        [rng.randrange(3, PROMPTS["vocab"]) for _ in range(rng.randint(1, PROMPTS["max_len"]))]
        for _ in range(PROMPTS["count"])
    ]
    hf = load_hf_model(path).to("cuda")
    want = [greedy_hf(hf, p, PROMPTS["tokens"]) for p in prompts]
    result: dict[str, Any] = {}
    for graphs in (True, False):
        got, replays = family_tokens(path, graphs, prompts)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        result["graphs" if graphs else "eager"] = {"exact": same, "replays": replays}
    result["prompts"] = len(prompts)
    return result


def families_section() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdserve-families-") as tmp:
        out: dict[str, Any] = {}
        for arch in FAMILIES:
            try:
                out[arch] = one_family(arch, Path(tmp))
            except Exception as e:  # one family failing must not hide the other's result
                out[arch] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        return out


def families_summary(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for arch, r in result.items():
        if "error" in r:
            rows.append([f"fp32 parity {arch}", f"error: {r['error'][:90]}", "token-exact", "FAIL"])
            continue
        for mode in ("graphs", "eager"):
            exact, n = r[mode]["exact"], r["prompts"]
            extra = f", {r[mode]['replays']} graph replays" if mode == "graphs" else ""
            ok = "ok" if exact == n and (mode == "eager" or r[mode]["replays"] > 0) else "FAIL"
            rows.append(
                [f"fp32 parity {arch} ({mode})", f"{exact}/{n} exact{extra}", "token-exact", ok]
            )
    return rows
