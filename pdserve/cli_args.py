"""The flags of every `pdserve` subcommand: one function per subcommand."""

from __future__ import annotations

import argparse

from decode_node.push_mode import PUSH_MODES
from pdserve.log_level import log_level_arg
from shared.serving import limits, tracing


def _engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The engine flags every node command takes (and `pdserve up` passes on to its nodes:
    `engine_argv`); returns them."""
    g = p.add_argument_group("engine")
    add = g.add_argument
    return [
        add(
            "--model",
            default="tiny",
            help="'tiny', 'smollm2' (built in), a GGUF file or a local Hugging Face directory",
        ),
        add("--block-size", type=int, default=16),
        add("--num-kv-blocks", type=int, default=0, help="0: size from --kv-cache-mb"),
        add("--kv-cache-mb", type=int, default=256),
        add("--max-batch-size", type=int, default=32),
        add(
            "--max-num-tokens",
            type=int,
            default=0,
            help="per-step token budget (chunked prefill); 0: the role's default, 8192 on a "
            "prefill node (no decode steps to protect: a prompt that long is one chunk), 512 "
            "elsewhere",
        ),
        add("--max-model-len", type=int, default=0),
        add("--no-prefix-caching", action="store_true"),
        add("--device", default="auto"),
        add(
            "--dtype",
            default="auto",
            help="auto (bf16 on CUDA and on CPUs with AMX / AVX-512 BF16, else float32), "
            "float32, bfloat16 or float16",
        ),
        add(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="decode steps through CUDA graphs (CUDA only; ignored on CPU)",
        ),
        log_level_arg(g),
        tracing.endpoint_arg(g),
    ]


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags `a` holds away from their defaults (but --model, which the caller
    passes itself), written back as command-line arguments: what `pdserve up` gives each
    node it starts."""
    argv: list[str] = []
    for action in _engine_args(argparse.ArgumentParser(add_help=False)):
        value = getattr(a, action.dest)
        if action.dest == "model" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _server_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (gRPC)")
    g.add_argument("--tls-cert", default="", help="server certificate (PEM); enables TLS")
    g.add_argument("--tls-key", default="", help="server private key (PEM)")
    g.add_argument("--tls-client-ca", default="", help="require client certs signed by this CA")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving"
    )
    from pdserve import plan  # its flags live with it, like the proxy's

    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_export_hf(sub)
    _add_prefill(sub)
    _add_colocated(sub, _add_decode(sub))
    _add_proxy(sub)
    plan.add_parser(sub)
    _add_bench(sub)
    _add_generate(sub)
    _add_build_kernels(sub)
    return parser


# one function per subcommand: `sub` is the parser's subparsers action
def _add_up(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a local cluster (separate processes)")
    _engine_args(up)  # passed on to every node
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument(
        "--max-restarts-per-minute",
        type=int,
        default=5,
        metavar="N",
        help="a node that exits unexpectedly is started again on its ports (after 0.5 s, "
        "doubling to 8 s), at most N times within any minute; then `up` stops (0: never)",
    )
    up.add_argument(
        "--port",
        type=int,
        default=None,
        help="first decode node's gRPC port (default: 50051; with --run, 0: ephemeral)",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="first decode node's HTTP port (default: 8000; with --run, 0: ephemeral; -1: off)",
    )
    up.add_argument(
        "--run",
        metavar="PROMPT",
        default=None,
        help="start, stream one greedy answer to PROMPT (as a chat user message when the model "
        "has a chat template), then stop (the newcomer's demo)",
    )
    up.add_argument("--max-tokens", type=int, default=32, help="with --run")
    tool_call_parser_arg(up)  # passed on to the decode nodes


def _add_export_hf(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export-hf", help="write a model as a Hugging Face directory")
    ex.add_argument("--model", required=True, help="tiny, smollm2, a GGUF file or an HF directory")
    ex.add_argument("out_dir", help="directory to write (created if missing)")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    log_level_arg(ex)


def _drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-grace",
        type=float,
        default=limits.DRAIN_GRACE_S,
        help="seconds in-flight requests may take to finish after SIGTERM before the rest are "
        f"aborted (default {limits.DRAIN_GRACE_S:g}; fit it in the orchestrator's grace period)",
    )


def _add_prefill(sub: argparse._SubParsersAction) -> None:
    pf = sub.add_parser("prefill", help="run one prefill node")
    _engine_args(pf)
    pf.add_argument("--host", default="127.0.0.1")
    pf.add_argument("--port", type=int, default=50061)
    pf.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    _drain_arg(pf)
    _server_tls_args(pf)


def _add_decode(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    dc = sub.add_parser("decode", help="run one decode node (the public front door)")
    _engine_args(dc)
    dc.add_argument("--prefill", required=True, help="HOST:PORT[,HOST:PORT...] of prefill nodes")
    dc.add_argument("--host", default="127.0.0.1")
    dc.add_argument("--port", type=int, default=50051)
    _ucx_args(dc)
    dc.add_argument("--metrics-port", type=int, default=0, help="-1 disables /metrics")
    _drain_arg(dc)
    _http_args(dc)
    _decode_limit_args(dc)
    dc.add_argument(
        "--push",
        choices=PUSH_MODES,
        default=None,
        help="how prefill nodes push the KV: layerwise (each layer as it is computed), whole "
        "(after the last layer), auto (default: whole from a prefill node on this host into a "
        "CPU pool, layer-wise otherwise)",
    )
    dc.add_argument(
        "--whole-request-push", action="store_true", help="the same as --push whole (older flag)"
    )
    dc.add_argument(
        "--window-aware-transfer",
        action="store_true",
        help="sliding-window layers are not pushed the prompt blocks out of their window "
        "(Gemma 2/3, Phi-3, windowed Qwen/Mistral: fewer KV bytes for long prompts)",
    )
    _local_prefill_args(dc)
    _server_tls_args(dc)
    client_tls_args(dc, "prefill-", "CA that signed the prefill nodes' certs")
    return dc


def _add_colocated(sub: argparse._SubParsersAction, dc: argparse.ArgumentParser) -> None:
    """A decode node with no prefill nodes that prefills every prompt itself: the same flags."""
    co = sub.add_parser(
        "colocated",
        parents=[dc],
        add_help=False,
        conflict_handler="resolve",
        help="run one colocated node (prefill and decode in one engine)",
    )
    co.add_argument("--prefill", default="", help=argparse.SUPPRESS)


def _local_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=256,
        help="prefill here a prompt with at most this many uncached tokens, in one step beside "
        "the decodes (0: never prefill here)",
    )
    p.add_argument(
        "--local-prefill-idle-tokens",
        type=int,
        default=2048,
        help="... and, while nothing decodes here, one with at most this many (0: off)",
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


def _ucx_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ucx-host",
        default="127.0.0.1",
        help="this node's KV transfer address, given to prefill nodes (and bound, see --ucx-bind)",
    )
    p.add_argument("--ucx-port", type=int, default=0, help="KV listener port (0: ephemeral)")
    p.add_argument(
        "--ucx-bind",
        default=None,
        metavar="ADDR",
        help="address the KV listener binds (default: --ucx-host; 0.0.0.0 for every interface)",
    )


def _decode_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-transfer-timeout", type=float, default=limits.KV_TRANSFER_TIMEOUT_S, help="seconds"
    )
    p.add_argument(
        "--prefill-timeout", type=float, default=limits.PREFILL_TIMEOUT_S, help="seconds"
    )
    p.add_argument("--prefill-retries", type=int, default=1)
    p.add_argument(
        "--max-inflight", type=int, default=256, help="requests holding KV blocks at once"
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests waiting (holding nothing) for KV blocks; past it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="default time-to-first-token target: a request predicted to miss it is refused "
        "at once (429 / RESOURCE_EXHAUSTED with Retry-After); default none",
    )
    p.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="default inter-token latency target: new requests wait while joining the decode "
        "batch would make its measured step time exceed it; default none",
    )
    p.add_argument(
        "--health-check-interval",
        type=float,
        default=limits.HEALTH_CHECK_INTERVAL_S,
        help="seconds",
    )


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    from pdserve.proxy import add_arguments as add_proxy_arguments

    add_proxy_arguments(sub.add_parser("proxy", help="gRPC proxy in front of the decode nodes"))


def _add_build_kernels(sub: argparse._SubParsersAction) -> None:
    from shared.model.kernel_build import add_arguments as add_build_arguments

    build = sub.add_parser("build-kernels", help="compile the C kernels for every CPU variant")
    add_build_arguments(build)
    log_level_arg(build)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import BENCHMARKS

    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)}")
    log_level_arg(bench)
    bench.add_argument("name", choices=list(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a decode node")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=120.0)
    log_level_arg(gen)
    client_tls_args(gen, "", "verify the server with this CA (enables TLS)")


def client_tls_args(p: argparse.ArgumentParser, prefix: str, ca_help: str) -> None:
    """--{prefix}tls-ca/-cert/-key: how this process, as a gRPC client, verifies and proves."""
    p.add_argument(f"--{prefix}tls-ca", default="", help=ca_help)
    p.add_argument(f"--{prefix}tls-cert", default="", help="client certificate (mutual TLS)")
    p.add_argument(f"--{prefix}tls-key", default="", help="client key (mutual TLS)")


def tool_call_parser_arg(p: argparse.ArgumentParser) -> None:
    why = 'how tool_choice "auto" reads calls (hermes: Qwen, Hermes; llama3_json: Llama 3.x)'
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], help=why)


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
    tool_call_parser_arg(p)
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)
    _http_connection_args(p)


def _http_connection_args(p: argparse.ArgumentParser) -> None:
    """What one HTTP client may hold (shared/serving/connection_limits.py)."""
    p.add_argument(
        "--http-header-timeout",
        type=float,
        default=limits.HTTP_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take to arrive (from its first byte, or from "
        "the connection's opening); then 408 and the connection is closed",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=limits.HTTP_BODY_TIMEOUT_S,
        help="seconds a request's whole body may take to arrive after its headers; then 408 and "
        "the connection is closed",
    )
    p.add_argument(
        "--http-keep-alive-timeout",
        type=float,
        default=limits.HTTP_KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--http-max-connections",
        type=int,
        default=limits.HTTP_MAX_CONNECTIONS,
        help="open HTTP connections at most; past it a request gets 503 with Retry-After "
        "(keep the process's open-file limit above it)",
    )
