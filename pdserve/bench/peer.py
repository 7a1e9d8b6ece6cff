"""`pdserve bench peer`: pdserve measured against vLLM on the same machine, weights, prompts and
cores, in one run: the offline engines (phase `engine`), OpenAI-HTTP serving under `vllm bench
serve` (phase `serve`), and P/D against vLLM's own P/D (NixlConnector; phase `pd`).

    python -m pdserve.bench.peer [--phases engine,serve,pd] [--out bench_out/peer] [--quick]

The vLLM venv is set up once under ~/.cache/pdserve/peers/vllm (pdserve/bench/peers/vllm_setup.py).
`--quick` (CI) never installs anything: without that venv it writes a `skipped` result and
says why; with it, it runs a tiny engine comparison on a tiny random-weight llama and checks the
shape of what it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pdserve.bench.peers import vllm_http, vllm_offline, vllm_online, vllm_report, vllm_setup
from pdserve.bench.peers.vllm_servers import ServerConfig
from pdserve.bench.support.util import environment, load_average, write_json

SKIP_MESSAGE = (
    "vLLM venv not found at {venv}: `pdserve bench peer --quick` never installs vLLM (CI must not "
    "download it); run `pdserve bench peer` once (or `python -m pdserve.bench.peers.vllm_setup`) "
    "to "
    "create it"
)
QUICK_MODEL = {  # head_dim 64: vLLM's CPU attention has kernels for it, not for tiny head dims
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench peer", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI: shape check, skip without vLLM")
    p.add_argument("--out", type=Path, default=Path("bench_out/peer"))
    p.add_argument("--phases", default="engine,serve,pd")
    p.add_argument("--cores", default="0-1", help="taskset list both systems get (engine, serve)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--requests", type=int, default=64, help="engine requests per batch limit")
    p.add_argument(
        "--batch1-requests", type=int, default=16, help="engine requests at batch limit 1"
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="engine: runs of each system per row, alternating; the row's ratio is the median"
        " of the pairs' ratios (one pair read 1.08-1.46x for the same code on these VMs)",
    )
    p.add_argument(
        "--omp-wait-policy",
        default="",
        help="OMP_WAIT_POLICY of every process of both systems ('': the environment's, i.e."
        " OpenMP's spin-then-sleep default). PASSIVE on a shared machine, where spinning threads"
        " wait on preempted peers at every op; on a quiet one PASSIVE costs pdserve 1.6x at two"
        " threads (every parallel region wakes a sleeping thread)",
    )
    p.add_argument("--model-dir", type=Path, default=None, help="HF dir (default: SmolLM2)")
    p.add_argument("--serve-dtype", default="bfloat16", help="serve and pd phases")
    p.add_argument("--rates", default="0.5,1,2,4", help="serve: request rates (req/s)")
    p.add_argument("--serve-prompts", type=int, default=32, help="serve: requests per rate")
    p.add_argument("--input-len", type=int, default=256, help="serve: random prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="serve: output tokens")
    p.add_argument("--slo", default="ttft:2000,tpot:100", help="goodput SLO (ms)")
    p.add_argument("--pd-lengths", default="16,128,512,1024,2048,4000")
    p.add_argument("--pd-repeats", type=int, default=3)
    g = p.add_argument_group("interference (serve phase)")
    g.add_argument("--decode-streams", type=int, default=4)
    g.add_argument("--decode-output-len", type=int, default=128)
    g.add_argument("--long-prompts", type=int, default=4)
    g.add_argument("--long-input-len", type=int, default=2048)
    a = p.parse_args(argv)
    if a.pairs < 1:
        p.error(f"--pairs {a.pairs}: at least one pair of runs per row")
    return a


def model_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def quick(a: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "peer",
        "quick": True,
        "environment": environment(),
        "load_average": load_average(),
    }
    if not vllm_setup.venv_ready():
        result["skipped"] = SKIP_MESSAGE.format(venv=vllm_setup.VENV)
        print(result["skipped"])
        write_json(a.out / "peer.json", result)
        return result
    from pdserve.bench.support.checkpoints import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint("llama", Path(tmp) / "peer-llama", seed=0, **QUICK_MODEL)
        w = vllm_offline.EngineWorkload(
            requests=4, prompt_range=(16, 48), output_range=(4, 8), kv_gib=1
        )
        rows = vllm_offline.run_phase(
            model,
            QUICK_MODEL["vocab_size"],
            vllm_setup.venv_python(),
            a.cores,
            ["float32"],
            {4: 4},
            w,
            a.out / "runs",
            pairs=1,  # a shape check; how pairs aggregate: tests/test_bench_peer_quick.py
        )
    result["engine"] = {"workload": w.__dict__, "rows": rows}
    vllm_report.write(a.out, result)
    return result


def engine_phase(a: argparse.Namespace, model: Path, python: Path, work: Path) -> dict[str, Any]:
    batches = {
        int(b): (a.batch1_requests if b == "1" else a.requests) for b in a.batches.split(",")
    }
    w = vllm_offline.EngineWorkload(requests=max(batches.values()))
    rows = vllm_offline.run_phase(
        model, model_vocab(model), python, a.cores, a.dtypes.split(","), batches, w, work, a.pairs
    )
    return {"workload": w.__dict__, "rows": rows}


def online_config(a: argparse.Namespace) -> vllm_online.OnlineConfig:
    return vllm_online.OnlineConfig(
        rates=tuple(float(r) for r in a.rates.split(",")),
        num_prompts=a.serve_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        slo=tuple(a.slo.split(",")),
        pd_lengths=tuple(int(n) for n in a.pd_lengths.split(",")),
        pd_repeats=a.pd_repeats,
        interference=vllm_http.Interference(
            decode_streams=a.decode_streams,
            decode_output_len=a.decode_output_len,
            long_prompts=a.long_prompts,
            long_input_len=a.long_input_len,
        ),
    )


def online_phases(
    a: argparse.Namespace, phases: list[str], model: Path, python: Path, work: Path
) -> dict[str, Any]:
    """The `serve` and `pd` entries of peer.json."""
    cfg = ServerConfig(model_dir=model, vllm_python=python, dtype=a.serve_dtype)
    oc = online_config(a)
    sessions = vllm_online.run_phases(phases, cfg, a.cores, oc, model_vocab(model), work)
    out: dict[str, Any] = {
        "serve": {
            "dtype": a.serve_dtype,
            "config": {**oc.__dict__, "interference": oc.interference.__dict__},
            "sweep": {k: v["sweep"] for k, v in sessions.items() if "sweep" in v},
            "interference": {
                k: v["interference"] for k, v in sessions.items() if "interference" in v
            },
            "load_average": {
                k: [v["load_average_start"], v["load_average_end"]] for k, v in sessions.items()
            },
        }
    }
    ttft = {k: v["ttft"] for k, v in sessions.items() if "ttft" in v}
    if ttft:
        out["pd"] = {"dtype": a.serve_dtype, "ttft": ttft}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy  # children inherit (child_env)
    if a.quick:
        return quick(a)
    python = vllm_setup.ensure_venv()
    model = a.model_dir or vllm_setup.ensure_model_dir()
    phases = a.phases.split(",")
    result: dict[str, Any] = {
        "benchmark": "peer",
        "quick": False,
        "model": str(model),
        "cores": a.cores,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "environment": environment(),
        "load_average": load_average(),
    }
    work = a.out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    if "engine" in phases:
        result["engine"] = engine_phase(a, model, python, work)
        vllm_report.write(a.out, result)
    online = [p for p in phases if p in ("serve", "pd")]
    if online:
        result.update(online_phases(a, online, model, python, work))
    result["load_average_end"] = load_average()
    vllm_report.write(a.out, result)
    return result


if __name__ == "__main__":
    main()
