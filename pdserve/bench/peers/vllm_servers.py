"""The servers `pdserve bench peer` measures over OpenAI HTTP, each started, waited for and always
stopped: `vllm serve` (colocated), vLLM 1 prefill + 1 decode (NixlConnector, CPU KV buffers) behind
pdserve/bench/peers/vllm_pd_proxy.py, pdserve 1 prefill + 1 decode, and `pdserve colocated`. Every
process is pinned with taskset; vLLM's OpenMP threads are bound to the same cores (two vLLM servers
on the same cores spin against each other).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.support import nodes as bench_nodes
from pdserve.bench.support.util import child_env, kill_group

READY_TIMEOUT_S = 900.0  # vLLM starts in ~25 s on an idle machine, minutes on a busy one
MODEL_NAME = "smollm2"


@dataclass(frozen=True)
class ServerConfig:
    model_dir: Path
    vllm_python: Path
    dtype: str
    max_model_len: int = 4608
    max_batch: int = 32
    kv_gib: int = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, procs: list[subprocess.Popen[Any]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode} before {url} was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


def _popen(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def vllm_server(
    cfg: ServerConfig,
    cores: str,
    port: int,
    log: Path,
    kv_role: str | None = None,
    side_port: int = 0,
) -> subprocess.Popen[Any]:
    python, model = str(cfg.vllm_python), str(cfg.model_dir)
    flags = f"--served-model-name {MODEL_NAME} --host 127.0.0.1 --port {port} --dtype {cfg.dtype}"
    flags += f" --enforce-eager --max-model-len {cfg.max_model_len}"
    flags += f" --max-num-seqs {cfg.max_batch} --seed 0"
    api_server = "vllm.entrypoints.openai.api_server"
    cmd = ["taskset", "-c", cores, python, "-m", api_server, "--model", model, *flags.split()]
    env = child_env(VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_gib), VLLM_CPU_OMP_THREADS_BIND=cores)
    env.pop("PYTHONPATH", None)
    if kv_role is not None:
        config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        cmd += ["--kv-transfer-config", json.dumps(config)]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    return _popen(cmd, env, log)


@contextlib.contextmanager
def vllm_colocated(cfg: ServerConfig, cores: str, logs: Path) -> Iterator[str]:
    port = free_port()
    proc = vllm_server(cfg, cores, port, logs / "vllm-serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, [proc], READY_TIMEOUT_S)
        yield url
    finally:
        kill_group(proc, grace=20.0)


@contextlib.contextmanager
def vllm_pd(cfg: ServerConfig, prefill_cores: str, decode_cores: str, logs: Path) -> Iterator[str]:
    """Producer and consumer one after the other (their start-ups would fight for the cores),
    then the two-request proxy; the proxy's URL."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        urls = []
        for role, cores in (("kv_producer", prefill_cores), ("kv_consumer", decode_cores)):
            port = free_port()
            log = logs / f"vllm-{role}.log"
            procs.append(vllm_server(cfg, cores, port, log, role, free_port()))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1], procs, READY_TIMEOUT_S)
        port = free_port()
        proxy = f"--port {port} --prefill {urls[0]} --decode {urls[1]}".split()
        cmd = [sys.executable, "-m", "pdserve.bench.peers.vllm_pd_proxy", *proxy]
        procs.append(_popen(cmd, child_env(), logs / "vllm-pd-proxy.log"))
        url = f"http://127.0.0.1:{port}"
        wait_http(url, procs, 120.0)
        yield url
    finally:
        for proc in reversed(procs):
            kill_group(proc, grace=20.0)


def _pdserve_engine(cfg: ServerConfig) -> dict[str, Any]:
    """The engine options every pdserve node of these sessions gets: vLLM's limits."""
    return {
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_batch_size": cfg.max_batch,
        "kv_cache_mb": cfg.kv_gib * 1024,
    }


@contextlib.contextmanager
def pdserve_pd(
    cfg: ServerConfig, prefill_cores: str, decode_cores: str, logs: Path, threads: int = 1
) -> Iterator[str]:
    """pdserve 1 prefill + 1 decode (real `pdserve prefill/decode` nodes); the decode node's
    HTTP URL."""
    base = bench_nodes.engine_args(str(cfg.model_dir), _pdserve_engine(cfg))
    decode = ["decode", *base, *f"--port 0 --http-port 0 --served-model-name {MODEL_NAME}".split()]
    # a 4k prompt takes > 30 s to prefill on one busy core
    decode += ["--prefill", "{port:prefill}", "--kv-transfer-timeout", "600"]
    decode += ["--prefill-timeout", "600"]
    prefill = ["prefill", *base, "--port", "0"]
    specs = [
        bench_nodes.NodeSpec("prefill", "pdserve.cli", prefill, prefill_cores, threads),
        bench_nodes.NodeSpec("decode", "pdserve.cli", decode, decode_cores, threads),
    ]
    with bench_nodes.running(specs, logs) as nodes:
        yield f"http://127.0.0.1:{nodes.nodes['decode'].info['http_port']}"


@contextlib.contextmanager
def pdserve_colocated(cfg: ServerConfig, cores: str, logs: Path) -> Iterator[str]:
    """`pdserve colocated` on both cores (two torch threads): the same hardware as vLLM
    colocated and as either P/D pair; its HTTP URL."""
    spec = bench_nodes.colocated_spec(str(cfg.model_dir), _pdserve_engine(cfg), cores, threads=2)
    spec.args += ["--served-model-name", MODEL_NAME]
    with bench_nodes.running([spec], logs) as nodes:
        yield nodes.http_url("colocated")
