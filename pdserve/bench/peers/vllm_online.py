"""Phases 2 and 3 of `pdserve bench peer`: serving over OpenAI HTTP.

One server session per system (start-up costs minutes on a busy machine), each running what the
phases ask of it: the request-rate sweep with `vllm bench serve` (random dataset, fixed seed) and
the long-prompt interference run (phase `serve`), TTFT against prompt length (phase `pd`).
Systems: vLLM colocated and `pdserve colocated` on both cores; pdserve 1P+1D and vLLM 1P+1D with
one core per node.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.peers import vllm_http, vllm_servers
from pdserve.bench.peers.vllm_servers import MODEL_NAME, ServerConfig
from pdserve.bench.support.util import REPO_ROOT, child_env, load_average

CLIENT = REPO_ROOT / "pdserve" / "bench" / "peers" / "vllm_bench_client.py"
METRICS = (
    "completed",
    "duration",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


@dataclass(frozen=True)
class OnlineConfig:
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    num_prompts: int = 32
    input_len: int = 256
    output_len: int = 64
    slo: tuple[str, ...] = ("ttft:2000", "tpot:100")  # ms, vllm bench serve's --goodput
    pd_lengths: tuple[int, ...] = (16, 128, 512, 1024, 2048, 4000)
    pd_repeats: int = 3
    interference: vllm_http.Interference = field(default_factory=vllm_http.Interference)
    seed: int = 0


def bench_serve(
    cfg: ServerConfig, url: str, rate: float, oc: OnlineConfig, out: Path, tag: str
) -> dict[str, Any]:
    """One `vllm bench serve` run at `rate`; the metrics it saved."""
    name = f"{tag}-rate{rate}.json"
    flags = f"--backend openai --base-url {url} --endpoint /v1/completions --model {MODEL_NAME}"
    flags += f" --dataset-name random --random-input-len {oc.input_len}"
    flags += f" --random-output-len {oc.output_len} --num-prompts {oc.num_prompts}"
    flags += f" --request-rate {rate} --seed {oc.seed} --ignore-eos"
    flags += " --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99"
    flags += f" --save-result --result-filename {name} --disable-tqdm --save-detailed"
    paths = ["--tokenizer", str(cfg.model_dir), "--result-dir", str(out)]
    cmd = [str(cfg.vllm_python), str(CLIENT), *flags.split(), *paths, "--goodput", *oc.slo]
    env = child_env()
    env.pop("PYTHONPATH", None)
    with open(out / f"{tag}-rate{rate}.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RuntimeError(f"vllm bench serve against {tag} failed ({code}); see {out}")
    saved = json.loads((out / name).read_text())
    row = {"rate": rate, **{k: saved[k] for k in METRICS if k in saved}}
    row["load_average"] = load_average()
    return row


def session(
    name: str,
    server: Callable[[], contextlib.AbstractContextManager[str]],
    tasks: list[str],
    cfg: ServerConfig,
    oc: OnlineConfig,
    vocab: int,
    out: Path,
    bar: tqdm,
) -> dict[str, Any]:
    result: dict[str, Any] = {"load_average_start": load_average()}
    with server() as url:
        for task in tasks:
            bar.set_postfix_str(f"{name}: {task}")
            if task == "sweep":
                result["sweep"] = [bench_serve(cfg, url, r, oc, out, name) for r in oc.rates]
                for row in result["sweep"]:
                    tqdm.write(f"{name:>18} rate {row['rate']:>4}: " + _brief(row))
            elif task == "interference":
                result["interference"] = vllm_http.interference(url, oc.interference, vocab)
                r = result["interference"]
                tqdm.write(
                    f"{name:>18} interference: decode ITL p99 alone"
                    f" {r['decode_itl_alone_ms']['p99']:.1f} ms, with long prompts"
                    f" {r['decode_itl_with_long_prompts_ms']['p99']:.1f} ms"
                )
            elif task == "ttft":
                result["ttft"] = vllm_http.ttft_sweep(
                    url, list(oc.pd_lengths), oc.pd_repeats, vocab, oc.seed
                )
                points = [f"{r['prompt_tokens']}: {r['ttft_ms_p50']:.0f}" for r in result["ttft"]]
                tqdm.write(f"{name:>18} TTFT p50 ms: " + ", ".join(points))
            bar.update(1)
    result["load_average_end"] = load_average()
    return result


def _brief(row: dict[str, Any]) -> str:
    return (
        f"TTFT p50/p99 {row.get('median_ttft_ms', 0):.0f}/{row.get('p99_ttft_ms', 0):.0f} ms"
        f"  ITL p99 {row.get('p99_itl_ms', 0):.0f} ms  goodput {row.get('request_goodput', 0):.2f}"
        f" req/s  out {row.get('output_throughput', 0):.1f} tok/s"
    )


def plan(phases: list[str], cores: str) -> dict[str, tuple[Callable[..., Any], list[str]]]:
    """system -> (server factory(cfg, logs), tasks), in run order."""
    one, two = cores.split(",")[0].split("-")[0], _second_core(cores)
    serve, pd = "serve" in phases, "pd" in phases
    systems: dict[str, tuple[Callable[..., Any], list[str]]] = {}
    if serve:
        systems["vllm_colocated"] = (
            lambda cfg, logs: vllm_servers.vllm_colocated(cfg, cores, logs),
            ["sweep", "interference"],
        )
        systems["pdserve_colocated"] = (
            lambda cfg, logs: vllm_servers.pdserve_colocated(cfg, cores, logs),
            ["sweep"],
        )
    tasks = (["sweep", "interference"] if serve else []) + (["ttft"] if pd else [])
    systems["pdserve_pd"] = (
        lambda cfg, logs: vllm_servers.pdserve_pd(cfg, one, two, logs),
        tasks,
    )
    if pd:
        systems["vllm_pd"] = (
            lambda cfg, logs: vllm_servers.vllm_pd(cfg, one, two, logs),
            ["ttft", "sweep", "interference"],
        )
    return systems


def _second_core(cores: str) -> str:
    from pdserve.bench.peers.vllm_offline import cpu_set

    ids = sorted(cpu_set(cores))
    return str(ids[1] if len(ids) > 1 else ids[0])


def run_phases(
    phases: list[str], cfg: ServerConfig, cores: str, oc: OnlineConfig, vocab: int, out: Path
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    systems = plan(phases, cores)
    bar = tqdm(total=sum(len(t) for _, t in systems.values()), desc="serving tasks", unit="task")
    results: dict[str, Any] = {}
    for name, (factory, tasks) in systems.items():
        with _noted(name):
            results[name] = session(
                name, lambda f=factory: f(cfg, out), tasks, cfg, oc, vocab, out, bar
            )
        (out / f"session-{name}.json").write_text(json.dumps(results[name], indent=1))
    bar.close()
    return results


@contextlib.contextmanager
def _noted(name: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        raise RuntimeError(f"serving session {name} failed: {e}") from e
