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
from shared.engine.sampling_params import SamplingParams
from shared.serving import limits
from shared.serving.tls import ClientTls, ServerTls


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="tiny",
        help="'tiny', 'smollm2' (built in), a GGUF file or a local Hugging Face directory",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=0, help="0: size from --kv-cache-mb")
    g.add_argument("--kv-cache-mb", type=int, default=256)
    g.add_argument("--max-batch-size", type=int, default=32)
    g.add_argument("--max-num-tokens", type=int, default=512, help="per-step token budget")
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps through CUDA graphs (CUDA only; ignored on CPU)",
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
        cuda_graphs=a.cuda_graphs,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local cluster (separate processes)")
    up.add_argument("--model", default="tiny", help="as for prefill/decode, e.g. smollm2")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument("--port", type=int, default=50051, help="first decode node's gRPC port")
    up.add_argument(
        "--http-port", type=int, default=8000, help="first decode node's HTTP port (-1: off)"
    )
    up.add_argument(
        "--run",
        metavar="PROMPT",
        default=None,
        help="start, stream one greedy answer to PROMPT (as a chat user message when the model "
        "has a chat template), then stop (the newcomer's demo)",
    )
    up.add_argument("--max-tokens", type=int, default=32, help="with --run")

    ex = sub.add_parser("export-hf", help="write a model as a Hugging Face directory")
    ex.add_argument("--model", required=True, help="tiny, smollm2, a GGUF file or an HF directory")
    ex.add_argument("out_dir", help="directory to write (created if missing)")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

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
    _http_args(dc)
    dc.add_argument(
        "--kv-transfer-timeout", type=float, default=limits.KV_TRANSFER_TIMEOUT_S, help="seconds"
    )
    dc.add_argument(
        "--prefill-timeout", type=float, default=limits.PREFILL_TIMEOUT_S, help="seconds"
    )
    dc.add_argument("--prefill-retries", type=int, default=1)
    dc.add_argument(
        "--max-inflight", type=int, default=256, help="requests holding KV blocks at once"
    )
    dc.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests waiting (holding nothing) for KV blocks; past it RESOURCE_EXHAUSTED",
    )
    dc.add_argument(
        "--health-check-interval",
        type=float,
        default=limits.HEALTH_CHECK_INTERVAL_S,
        help="seconds",
    )
    dc.add_argument("--whole-request-push", action="store_true", help="disable layer-wise push")
    _local_prefill_args(dc)
    _server_tls_args(dc)
    dc.add_argument("--prefill-tls-ca", default="", help="CA that signed the prefill nodes' certs")
    dc.add_argument("--prefill-tls-cert", default="", help="client cert for mutual TLS")
    dc.add_argument("--prefill-tls-key", default="", help="client key for mutual TLS")

    # a decode node with no prefill nodes that prefills every prompt itself: the same flags
    co = sub.add_parser(
        "colocated",
        parents=[dc],
        add_help=False,
        conflict_handler="resolve",
        help="run one colocated node (prefill and decode in one engine)",
    )
    co.add_argument("--prefill", default="", help=argparse.SUPPRESS)

    from pdserve.proxy import add_arguments as add_proxy_arguments

    add_proxy_arguments(sub.add_parser("proxy", help="gRPC proxy in front of the decode nodes"))

    bench = sub.add_parser("bench", help="benchmarks: transfer, serve, ttft, engine")
    bench.add_argument("name", choices=["transfer", "serve", "ttft", "engine"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")

    gen = sub.add_parser("generate", help="stream a completion from a decode node")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=120.0)
    gen.add_argument("--tls-ca", default="", help="verify the server with this CA (enables TLS)")
    gen.add_argument("--tls-cert", default="", help="client certificate (mutual TLS)")
    gen.add_argument("--tls-key", default="", help="client key (mutual TLS)")
    return parser


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="OpenAI-compatible HTTP API, also /metrics /health /version (0: ephemeral, -1: off)",
    )
    p.add_argument("--served-model-name", default="", help="the `model` HTTP requests name")
    p.add_argument("--api-key", default=None, help="require this HTTP bearer token")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="override the model's")
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)


def cmd_up(a: argparse.Namespace) -> int:
    from pdserve.cluster import Cluster

    prompt: str | list[int] | None = None
    if a.run is not None:
        try:
            prompt = run_prompt(a.model, a.run)
        except (ValueError, OSError) as e:
            print(f"pdserve up: model {a.model!r}: {e}", file=sys.stderr)
            return 2
    cluster = Cluster(a.model, a.prefill, a.decode, a.port, [], http_port=a.http_port)
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
        if cluster.http_endpoints:
            http = cluster.http_endpoints
            more = f" (all: {', '.join(http)})" if len(http) > 1 else ""
            print(f"HTTP (OpenAI API): {http[0]}/v1{more}")
        if prompt is not None:
            code = _stream_to_stdout(endpoints[0], prompt, SamplingParams(max_tokens=a.max_tokens))
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


def run_prompt(model: str, text: str) -> str | list[int]:
    """`--run`'s prompt: `text` as one user message through the model's chat template (with
    the generation prompt), as token ids encoded without special tokens since the template
    writes any BOS itself; the raw text when the model has no template."""
    from shared.model.loader import load_tokenizer_and_template

    tokenizer, template = load_tokenizer_and_template(model)
    if template is None:
        return text
    rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def cmd_generate(a: argparse.Namespace) -> int:
    tls = ClientTls(a.tls_ca, a.tls_cert, a.tls_key) if a.tls_ca else None
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        stop=tuple(a.stop),
        ignore_eos=a.ignore_eos,
    )
    return _stream_to_stdout(a.target, a.prompt, params, timeout=a.timeout, tls=tls)


def _stream_to_stdout(
    target: str,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    timeout: float | None = None,
    tls: ClientTls | None = None,
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
            generate_stream(target, prompt, params, timeout=timeout, channel=channel)
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
    "engine": "benchmarks.engine",
}


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[a.name])
    module.main(a.args)
    return 0


def _local_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="prefill here a prompt with at most this many uncached tokens (0: never)",
    )
    p.add_argument(
        "--prefill-routing",
        choices=["kv", "least-loaded", "round-robin"],
        default="kv",
        help="kv: the prefill node with the fewest prompt tokens to compute plus outstanding work",
    )
    p.add_argument(
        "--local-prefill-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when no prefill node is healthy, prefill here instead of UNAVAILABLE",
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "up":
        return cmd_up(a)
    if a.command == "generate":
        return cmd_generate(a)
    if a.command == "bench":
        return cmd_bench(a)
    if a.command == "export-hf":
        from pdserve.export_hf import run as run_export

        return run_export(a)
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
                prefill_targets=tuple(
                    t.strip() for t in getattr(a, "prefill", "").split(",") if t.strip()
                ),
                colocated=a.command == "colocated",
                host=a.host,
                port=a.port,
                ucx_host=a.ucx_host,
                ucx_port=a.ucx_port,
                ucx_bind_host=a.ucx_bind,
                metrics_port=a.metrics_port,
                http_port=a.http_port,
                served_model_name=a.served_model_name,
                api_key=a.api_key,
                chat_template=a.chat_template,
                max_request_bytes=a.max_request_bytes,
                kv_transfer_timeout=a.kv_transfer_timeout,
                prefill_timeout=a.prefill_timeout,
                prefill_retries=a.prefill_retries,
                max_inflight=a.max_inflight,
                max_queued=a.max_queued,
                health_check_interval=a.health_check_interval,
                local_prefill_tokens=a.local_prefill_tokens,
                local_prefill_fallback=a.local_prefill_fallback,
                prefill_routing=a.prefill_routing,
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
