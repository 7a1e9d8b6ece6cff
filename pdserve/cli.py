"""The `pdserve` command: up, prefill, decode, generate."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from decode_node.config import DecodeNodeConfig
from prefill_node.config import PrefillNodeConfig
from shared.engine.config import EngineConfig
from shared.serving.tls import ClientTls, ServerTls


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="'tiny' (built in) or a local HF directory")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="0: size from --kv-cache-mb")
    g.add_argument("--kv-cache-mb", type=int, default=256)
    g.add_argument("--max-batch-size", type=int, default=32)
    g.add_argument("--max-num-tokens", type=int, default=512, help="per-step token budget")
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--device", default="auto")
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CUDA and on CPUs with AMX / AVX-512 BF16, else float32), float32, "
        "bfloat16 or float16",
    )
    g.add_argument("--log-level", default="info")


def _server_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (gRPC)")
    g.add_argument("--tls-cert", default="", help="server certificate (PEM); enables TLS")
    g.add_argument("--tls-key", default="", help="server private key (PEM)")
    g.add_argument("--tls-client-ca", default="", help="require client certs signed by this CA")


def _server_tls(a: argparse.Namespace) -> ServerTls | None:
    if not a.tls_cert and not a.tls_key:
        return None
    return ServerTls(a.tls_cert, a.tls_key, a.tls_client_ca)


def _engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        kv_cache_memory_mb=a.kv_cache_mb,
        max_batch_size=a.max_batch_size,
        max_num_tokens=a.max_num_tokens,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        device=a.device,
        dtype=a.dtype,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local cluster (separate processes)")
    up.add_argument("--model", default="tiny")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument("--port", type=int, default=50051, help="first decode node's gRPC port")
    up.add_argument(
        "--run",
        metavar="PROMPT",
        default=None,
        help="start, stream one greedy completion of PROMPT, then stop (the newcomer's demo)",
    )
    up.add_argument("--max-tokens", type=int, default=32, help="with --run")

    pf = sub.add_parser("prefill", help="run one prefill node")
    _engine_args(pf)
    pf.add_argument("--host", default="127.0.0.1")
    pf.add_argument("--port", type=int, default=50061)
    pf.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    _server_tls_args(pf)

    dc = sub.add_parser("decode", help="run one decode node (the public front door)")
    _engine_args(dc)
    dc.add_argument("--prefill", required=True, help="HOST:PORT[,HOST:PORT...] of prefill nodes")
    dc.add_argument("--host", default="127.0.0.1")
    dc.add_argument("--port", type=int, default=50051)
    dc.add_argument(
        "--ucx-host",
        default="127.0.0.1",
        help="this node's KV transfer address, given to prefill nodes (and bound, see --ucx-bind)",
    )
    dc.add_argument("--ucx-port", type=int, default=0, help="KV listener port (0: ephemeral)")
    dc.add_argument(
        "--ucx-bind",
        default=None,
        metavar="ADDR",
        help="address the KV listener binds (default: --ucx-host; 0.0.0.0 for every interface)",
    )
    dc.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    dc.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds")
    dc.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds")
    dc.add_argument("--prefill-retries", type=int, default=1)
    dc.add_argument("--max-inflight", type=int, default=256)
    dc.add_argument("--health-check-interval", type=float, default=2.0, help="seconds")
    dc.add_argument("--whole-request-push", action="store_true", help="disable layer-wise push")
    _server_tls_args(dc)
    dc.add_argument("--prefill-tls-ca", default="", help="CA that signed the prefill nodes' certs")
    dc.add_argument("--prefill-tls-cert", default="", help="client cert for mutual TLS")
    dc.add_argument("--prefill-tls-key", default="", help="client key for mutual TLS")

    from pdserve.proxy import add_arguments as add_proxy_arguments

    add_proxy_arguments(sub.add_parser("proxy", help="gRPC proxy in front of the decode nodes"))

    bench = sub.add_parser("bench", help="benchmarks: transfer, serve, ttft, engine, roofline")
    bench.add_argument("name", choices=["transfer", "serve", "ttft", "engine", "roofline"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")

    gen = sub.add_parser("generate", help="stream a completion from a decode node")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=120.0)
    gen.add_argument("--tls-ca", default="", help="verify the server with this CA (enables TLS)")
    gen.add_argument("--tls-cert", default="", help="client certificate (mutual TLS)")
    gen.add_argument("--tls-key", default="", help="client key (mutual TLS)")
    return parser


def cmd_up(a: argparse.Namespace) -> int:
    from pdserve.cluster import Cluster

    cluster = Cluster(a.model, a.prefill, a.decode, a.port, [])
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        endpoints = cluster.start()
        print(f"pdserve is up: {a.prefill} prefill + {a.decode} decode node(s), model {a.model}")
        others = f" (all decode nodes: {', '.join(endpoints)})" if len(endpoints) > 1 else ""
        print(f"endpoint: {endpoints[0]}{others}")
        if a.run is not None:
            code = _stream_to_stdout(endpoints[0], a.run, max_tokens=a.max_tokens)
            print("stopping...", flush=True)
            return max(code, cluster.stop())
        print(f'try: pdserve generate "Hello" --target {endpoints[0]}   (Ctrl-C stops)', flush=True)
        while not stop and all(n.proc.poll() is None for n in cluster.nodes):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"pdserve up failed: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    print("stopping...", flush=True)
    code = cluster.stop()
    print("stopped" + ("" if code == 0 else f" (a node exited with {code})"), flush=True)
    return code


def cmd_generate(a: argparse.Namespace) -> int:
    tls = ClientTls(a.tls_ca, a.tls_cert, a.tls_key) if a.tls_ca else None
    return _stream_to_stdout(
        a.target,
        a.prompt,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=tuple(a.stop),
        ignore_eos=a.ignore_eos,
        timeout=a.timeout,
        tls=tls,
    )


def _stream_to_stdout(
    target: str, prompt: str, *, tls: ClientTls | None = None, **sampling: object
) -> int:
    """Stream a completion's text as it arrives; a summary line goes to stderr."""
    import contextlib

    import grpc

    from pdserve.client import finish_reason_name, generate_stream

    async def run() -> int:
        channel = None
        if tls is not None:
            tls.validate()
            channel = grpc.aio.secure_channel(target, tls.credentials())
        finish = ""
        usage = timing = None
        async with contextlib.aclosing(
            generate_stream(target, prompt, channel=channel, **sampling)  # type: ignore[arg-type]
        ) as stream:
            async for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    finish = finish_reason_name(chunk.finish_reason)
                    usage, timing = chunk.usage, chunk.timing
        print(flush=True)
        if usage is None or timing is None:
            print("error: the stream ended without a final message", file=sys.stderr)
            return 2
        print(
            f"[finish={finish} prompt_tokens={usage.prompt_tokens} completion_tokens="
            f"{usage.completion_tokens} cached_tokens={usage.cached_tokens} "
            f"ttft={timing.time_to_first_token_seconds * 1e3:.1f}ms]",
            file=sys.stderr,
            flush=True,
        )
        return 0

    try:
        return asyncio.run(run())
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


BENCHMARKS = {
    "transfer": "benchmarks.transfer",
    "serve": "benchmarks.serve",
    "ttft": "benchmarks.ttft",
    "engine": "benchmarks.engine_throughput",
    "roofline": "benchmarks.roofline",
}


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[a.name])
    module.main(a.args)
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "up":
        return cmd_up(a)
    if a.command == "generate":
        return cmd_generate(a)
    if a.command == "bench":
        return cmd_bench(a)
    if a.command == "proxy":
        from pdserve.proxy import run as run_proxy

        return run_proxy(a)
    from pdserve.nodes import run_decode, run_prefill, setup_logging

    setup_logging(a.log_level)
    try:
        if a.command == "prefill":
            return run_prefill(
                PrefillNodeConfig(
                    engine=_engine_config(a),
                    host=a.host,
                    port=a.port,
                    metrics_port=a.metrics_port,
                    tls=_server_tls(a),
                )
            )
        return run_decode(
            DecodeNodeConfig(
                engine=_engine_config(a),
                prefill_targets=tuple(t.strip() for t in a.prefill.split(",") if t.strip()),
                host=a.host,
                port=a.port,
                ucx_host=a.ucx_host,
                ucx_port=a.ucx_port,
                ucx_bind_host=a.ucx_bind,
                metrics_port=a.metrics_port,
                kv_transfer_timeout=a.kv_transfer_timeout,
                prefill_timeout=a.prefill_timeout,
                prefill_retries=a.prefill_retries,
                max_inflight=a.max_inflight,
                health_check_interval=a.health_check_interval,
                layerwise=not a.whole_request_push,
                tls=_server_tls(a),
                prefill_tls=(
                    ClientTls(a.prefill_tls_ca, a.prefill_tls_cert, a.prefill_tls_key)
                    if a.prefill_tls_ca
                    else None
                ),
            )
        )
    except ValueError as e:
        print(f"pdserve {a.command}: invalid configuration: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
