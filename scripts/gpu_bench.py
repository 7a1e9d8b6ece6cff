"""The GPU benchmark scripts/gpu-check runs (one short run, every ratio within it).

Sections, in order, each skipped with a row saying so when the time budget is spent:

* copy      device-to-device torch copy of 1 GiB (bytes copied per second);
* perftest  `ucx_perftest -t tag_bw -m cuda` between two processes on the GPU (the libucx wheel's
            binary), 64 MiB messages: the raw UCX ceiling for the KV push;
* pd        per model (SmolLM2-135M-shaped and a 1.1B Llama-shaped config, dummy weights written
            as a checkpoint here): one prefill and two decode processes on the GPU (layer-wise
            and whole-request push), one request at a time; TTFT broken down by the nodes'
            Timing (queue, prefill, transfer tail, other), and KV push GB/s = KV bytes /
            transfer time of the whole-request push (it starts after the last layer);
* decode    decode tokens/s on the SmolLM2-shaped model at batch 1/32/128, CUDA graphs on and
            off, against transformers' `generate` on the same weights.

Writes --out/gpu_bench.json (`summary`: the rows gpu_check prints). `--dry-run` builds the plan
on CPU (configs parse, prompts fit, state-dict names) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M(-Instruct)'s config.json shapes; weights are dummy (the GGUF is not carried)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B's shapes with a 32k vocabulary: 32 KiB of bf16 KV per token
    "llama-1.1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
PROMPT_LENGTHS = [128, 1024, 4096]
REPS = 3
DECODE_BATCHES = [1, 32, 128]
DECODE_PROMPT, DECODE_TOKENS = 64, 64
PERFTEST_BYTES = 64 * 2**20


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def config_json(name: str) -> dict[str, Any]:
    c = MODELS[name]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "bfloat16",
        **c,
    }


def kv_bytes_per_token(name: str, itemsize: int = 2) -> int:
    c = MODELS[name]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * itemsize


def param_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, from pdserve's own model on the meta device."""
    import torch

    from shared.model.config import ModelConfig
    from shared.model.llama import Model

    model = Model(ModelConfig.from_hf_config_dict(config_json(name)), "meta", torch.bfloat16)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def write_checkpoint(name: str, root: Path) -> Path:
    """config.json, dummy bf16 weights (drawn on the GPU: seconds, not minutes), tokenizer."""
    import torch
    from safetensors.torch import save_file

    from tests.checkpoints import build_tokenizer

    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    tensors = {}
    for n, shape in param_shapes(name).items():
        if n.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        tensors[n] = t.cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config_json(name), indent=1))
    build_tokenizer().save(str(out / "tokenizer.json"))
    return out


# ---- bandwidth ------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 20 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def perftest_binary() -> Path | None:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ucx_perftest"
    return binary if binary.is_file() else None


def perftest_cuda(binary: Path) -> float:
    """GB/s of `ucx_perftest tag_bw -m cuda` (server and client processes, one GPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(binary.parent.parent / "lib"),
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    args = ["-t", "tag_bw", "-m", "cuda", "-s", str(PERFTEST_BYTES), "-n", "200", "-p", port]
    server = subprocess.Popen(
        [str(binary), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [str(binary), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.kill()
        server.wait()
    final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest gave no result: {out.stdout[-500:]}{out.stderr[-500:]}")
    return float(final[-1].split()[6]) * 2**20 / 1e9  # bandwidth overall, MB/s (2^20 B)


# ---- P/D TTFT and KV push -------------------------------------------------------------------
def pd_nodes(path: Path) -> tuple[list[Any], dict[str, str]]:
    from pdserve.cluster import spawn, wait_ready

    engine = [
        "--model",
        str(path),
        "--port",
        "0",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--num-kv-blocks",
        "1024",
        "--max-num-tokens",
        "8192",
    ]
    prefill = spawn("prefill", engine, echo=False)
    wait_ready([prefill], 180)
    target = ["--prefill", f"127.0.0.1:{prefill.info['port']}"]
    layerwise = spawn("decode", [*engine, *target], echo=False)
    whole = spawn("decode", [*engine, *target, "--whole-request-push"], echo=False)
    nodes = [prefill, layerwise, whole]
    wait_ready(nodes, 180)
    return nodes, {
        m: f"127.0.0.1:{n.info['port']}" for m, n in (("layerwise", layerwise), ("whole", whole))
    }


def pd_section(name: str, path: Path, budget: Budget) -> dict[str, Any]:
    from pdserve.client import generate
    from pdserve.cluster import stop_all

    nodes, targets = pd_nodes(path)
    rng = random.Random(7)
    rows: list[dict[str, Any]] = []

    async def body() -> None:
        for n in [16, *PROMPT_LENGTHS]:  # 16: warm-up, not reported
            for rep in range(REPS if n != 16 else 1):
                for mode, target in targets.items():
                    if budget.left() < 20:
                        return
                    prompt = [rng.randrange(300, 30000) for _ in range(n)]
                    t0 = time.monotonic()
                    r = await generate(target, prompt, max_tokens=2, ignore_eos=True, timeout=120)
                    if n == 16:
                        continue
                    t = r.timing
                    rows.append(
                        {
                            "mode": mode,
                            "tokens": n,
                            "rep": rep,
                            "client_ttft": time.monotonic() - t0,
                            "ttft": t.time_to_first_token_seconds,
                            "queue": t.queue_seconds,
                            "prefill": t.prefill_seconds,
                            "tail": t.kv_transfer_seconds,
                        }
                    )

    try:
        asyncio.run(body())
    finally:
        stop_all(nodes)
    return {"model": name, "kv_bytes_per_token": kv_bytes_per_token(name), "requests": rows}


def pd_summary(result: dict[str, Any], perftest: float | None) -> list[list[str]]:
    out, name, per_token = [], result["model"], result["kv_bytes_per_token"]
    for n in PROMPT_LENGTHS:
        lw = [r for r in result["requests"] if r["tokens"] == n and r["mode"] == "layerwise"]
        wh = [r for r in result["requests"] if r["tokens"] == n and r["mode"] == "whole"]
        if lw:
            med = {
                k: statistics.median(r[k] for r in lw) for k in ("ttft", "queue", "prefill", "tail")
            }
            other = med["ttft"] - med["queue"] - med["prefill"] - med["tail"]
            ratio = med["tail"] / med["prefill"] if med["prefill"] else float("inf")
            ok = "" if n < 1024 else ("ok" if ratio <= 0.10 else "FAIL")
            out.append(
                [
                    f"TTFT {name} {n} tok (layer-wise): ttft/queue/prefill/tail/other ms",
                    "/".join(f"{v * 1e3:.1f}" for v in (*med.values(), other)),
                    f"tail/prefill {ratio:.2f} (<= 0.10 for >= 1k)",
                    ok,
                ]
            )
        if wh:
            tail = statistics.median(r["tail"] for r in wh)
            payload = n * per_token
            gbs = payload / tail / 1e9 if tail > 0 else float("inf")
            target, ok = "", ""
            if perftest and payload >= 16 * 2**20:
                target, ok = (
                    f">= 0.8x perftest: {gbs / perftest:.2f}x",
                    ("ok" if gbs >= 0.8 * perftest else "FAIL"),
                )
            out.append(
                [
                    f"KV push {name} {n} tok ({payload / 2**20:.0f} MiB), GB/s",
                    f"{gbs:.1f}",
                    target,
                    ok,
                ]
            )
    return out


# ---- decode tokens/s ------------------------------------------------------------------------
def engine_decode_rate(path: Path, batch: int, graphs: bool) -> float:
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.core import EngineCore
    from shared.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(path),
        num_kv_blocks=2048,
        max_batch_size=128,
        max_num_tokens=8192,
        device="cuda",
        dtype="bfloat16",
        cuda_graphs=graphs,
    )
    core = EngineCore(config)
    rng = random.Random(batch)
    rate = 0.0
    for _ in range(2):  # the first round captures the graphs, the second is timed
        for _ in range(batch):
            prompt = [rng.randrange(300, 30000) for _ in range(DECODE_PROMPT)]
            core.add_request(prompt, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True))
        first = 0
        while first < batch:
            first += len(core.step())
        torch.cuda.synchronize()
        t0, tokens = time.perf_counter(), 0
        while core.has_work:
            tokens += sum(len(d.token_ids) for d in core.step())
        torch.cuda.synchronize()
        rate = tokens / (time.perf_counter() - t0)
    assert core.shutdown()
    return rate


def hf_decode_rate(model: Any, batch: int) -> float:
    import torch

    ids = torch.randint(300, 30000, (batch, DECODE_PROMPT), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, **kwargs)
        torch.cuda.synchronize()
    return batch * DECODE_TOKENS / (time.perf_counter() - t0)


def decode_section(path: Path, budget: Budget) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    rates: dict[str, dict[str, float]] = {}
    for b in DECODE_BATCHES:
        if budget.left() < 25:
            break
        rates[str(b)] = {
            "graphs": engine_decode_rate(path, b, True),
            "eager": engine_decode_rate(path, b, False),
            "transformers": hf_decode_rate(hf, b),
        }
    return {"prompt_tokens": DECODE_PROMPT, "new_tokens": DECODE_TOKENS, "tokens_per_s": rates}


def decode_summary(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for b, r in result["tokens_per_s"].items():
        target, ok = "", ""
        if b == "1":
            x = r["graphs"] / r["eager"]
            target, ok = f"graphs >= 2x eager: {x:.2f}x", "ok" if x >= 2 else "FAIL"
        if b == "32":
            x = r["graphs"] / r["transformers"]
            target, ok = f"graphs >= 5x generate: {x:.2f}x", "ok" if x >= 5 else "FAIL"
        out.append(
            [
                f"decode tok/s smollm2 B={b}: graphs / eager / transformers",
                f"{r['graphs']:.0f} / {r['eager']:.0f} / {r['transformers']:.0f}",
                target,
                ok,
            ]
        )
    return out


# ---- driver ---------------------------------------------------------------------------------
def dry_run() -> int:
    for name in MODELS:
        shapes = param_shapes(name)
        params = sum(int(__import__("math").prod(s)) for s in shapes.values())
        longest = max(PROMPT_LENGTHS) + 2
        assert longest <= MODELS[name]["max_position_embeddings"], f"{name}: prompts too long"
        print(f"plan {name}: {params / 1e6:.0f}M params, {kv_bytes_per_token(name)} KV B/token")
    binary = perftest_binary()
    print(
        f"bench plan ok: {len(MODELS)} models, lengths {PROMPT_LENGTHS}, "
        f"batches {DECODE_BATCHES}, ucx_perftest {'found' if binary else 'not installed'}"
    )
    return 0


def section(result: dict[str, Any], key: str, fn: Any, out: Path) -> Any:
    try:
        result[key] = fn()
    except Exception as e:  # one failing section must not hide the others' numbers
        result[key] = {"error": f"{type(e).__name__}: {e}"}
        result["summary"].append([key, f"error: {type(e).__name__}: {str(e)[:80]}", "", "FAIL"])
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return result[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    if a.dry_run:
        return dry_run()
    import torch

    budget = Budget(a.budget)
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "summary": [],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    copy = section(result, "copy_gbs", copy_bandwidth, a.out)
    if isinstance(copy, float):
        result["summary"].append(["D2D copy (torch, 1 GiB), GB/s", f"{copy:.0f}", "ceiling", ""])
    binary = perftest_binary()
    perf = section(result, "perftest_gbs", lambda: perftest_cuda(binary) if binary else None, a.out)
    perf = perf if isinstance(perf, float) else None
    result["summary"].append(
        [
            "ucx_perftest -m cuda 64 MiB, GB/s",
            f"{perf:.1f}" if perf else "not run",
            "KV push reference",
            "",
        ]
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        paths = {
            n: section(result, f"checkpoint_{n}", lambda n=n: write_checkpoint(n, Path(tmp)), a.out)
            for n in MODELS
        }
        result.update({f"checkpoint_{n}": str(v) for n, v in paths.items()})
        if isinstance(paths["smollm2-135m"], Path):
            dec = section(
                result, "decode", lambda: decode_section(paths["smollm2-135m"], budget), a.out
            )
            if "tokens_per_s" in dec:
                result["summary"] += decode_summary(dec)
        for n, path in paths.items():
            if not isinstance(path, Path) or budget.left() < 40:
                result["summary"].append([f"P/D {n}", "skipped: time budget", "", ""])
                continue
            pd = section(
                result, f"pd_{n}", lambda n=n, path=path: pd_section(n, path, budget), a.out
            )
            if "requests" in pd:
                result["summary"] += pd_summary(pd, perf)
    (a.out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
