"""The `pdserve` command: up, prefill, decode, generate."""

from __future__ import annotations

import os
import sys

from shared.engine.scheduling import wait_policy

# First, before anything imports torch: its OpenMP runtime reads the wait policy once, on load
os.environ.update(wait_policy.node_defaults(sys.argv[1:2], os.environ))

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import subprocess
from typing import IO, TYPE_CHECKING, Any, NoReturn, TextIO, TypeVar

from decode_node.config import DecodeNodeConfig
from pdserve.bench import BENCHMARKS
from pdserve.bound_ports import check_bound_ports, port_in_use_line, up_front_door, up_ports
from pdserve.cli.cluster_args import node_argv
from pdserve.cli.parser import build_parser
from prefill_node.config import PREFILL_MAX_NUM_TOKENS, PrefillNodeConfig
from shared.engine.config import EngineConfig
from shared.engine.sampling.sampling_params import SamplingParams
from shared.engine.speculative.config import SpeculativeConfig
from shared.serving import tracing
from shared.serving.port_in_use import PortInUse
from shared.serving.tls import ClientTls, ServerTls
from transfer.errors import KvPortInUse

if TYPE_CHECKING:
    from pdserve.cluster import Cluster, NodeProcess

__all__ = ["BENCHMARKS", "build_parser", "from_args", "main", "run_prompt"]

T = TypeVar("T")


def _server_tls(a: argparse.Namespace) -> ServerTls | None:
    if not a.tls_cert and not a.tls_key:
        return None
    return ServerTls(a.tls_cert, a.tls_key, a.tls_client_ca)


def client_tls(a: argparse.Namespace, prefix: str) -> ClientTls | None:
    """From `tls_args.client_tls_args`' flags; None (plaintext) without a CA."""
    ca, cert, key = (getattr(a, f"{prefix}tls_{part}") for part in ("ca", "cert", "key"))
    return ClientTls(ca, cert, key) if ca else None


def from_args(cls: type[T], a: argparse.Namespace, **overrides: Any) -> T:
    """A config dataclass from the flags named after its fields, plus `overrides` for the
    rest: each flag is mapped once, where it is declared (the `*_args` modules)."""
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)}
    return cls(**{**given, **overrides})


def speculative_config(text: str) -> SpeculativeConfig | None:
    """`--speculative-config`'s JSON (ValueError naming what is wrong); '': off."""
    return SpeculativeConfig.from_json(text) if text else None


def _engine_config(a: argparse.Namespace, step_tokens: int | None = None) -> EngineConfig:
    """`step_tokens`: the role's step budget when --max-num-tokens is 0 (None: the engine's)."""
    budget = a.max_num_tokens or step_tokens or EngineConfig.max_num_tokens
    return from_args(
        EngineConfig,
        a,
        kv_cache_memory_mb=a.kv_cache_mb,
        enable_prefix_caching=not a.no_prefix_caching,
        max_num_tokens=budget,
        speculative=speculative_config(a.speculative_config),
        lora_modules=tuple(a.lora_modules),
    )


def cmd_up(a: argparse.Namespace) -> int:
    """Without --run, what it says goes to stdout; with --run, only the answer and its summary
    line do (the rest goes to stderr)."""
    from pdserve.cluster import Cluster
    from pdserve.supervisor import RestartPolicy, Supervisor

    prompt: str | list[int] | None = None
    if a.run is not None:
        try:
            prompt = run_prompt(a.model, a.run)
        except (ValueError, OSError) as e:
            print(f"pdserve up: model {a.model!r}: {e}", file=sys.stderr)
            return 2
    out = sys.stdout if prompt is None else sys.stderr
    port, http_port = up_ports(a)
    front_door = up_front_door(a)
    cluster = Cluster(
        a.model, a.prefill, a.decode, port, [], http_port=http_port, front_door=front_door
    )
    cluster.prefill_extra, cluster.decode_extra = node_argv(a, "prefill"), node_argv(a, "decode")
    stop = False
    gave_up: str | None = None  # why the supervisor stopped restarting nodes

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        endpoints = cluster.start()
        print(
            f"pdserve is up: {a.prefill} prefill + {a.decode} decode node(s), model {a.model}",
            file=out,
        )
        _print_endpoints(cluster, endpoints, out)
        if prompt is not None:
            params = SamplingParams(max_tokens=a.max_tokens)
            code = _stream_to_stdout(endpoints[0], prompt, params, summary=sys.stdout)
            print("stopping...", file=out, flush=True)
            return max(code, cluster.stop())
        target = cluster.front_door_endpoint or endpoints[0]
        print(f'try: pdserve generate "Hello" --target {target}   (Ctrl-C stops)', flush=True)
        policy = RestartPolicy(a.max_restarts_per_minute)
        gave_up = Supervisor(cluster, policy).run(lambda: stop)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        if _refused(cluster.nodes):
            cluster.stop()
            return 2  # the node said why on stderr, in the one line `up` would print
        print(f"pdserve up failed: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    if gave_up is not None:
        print(f"pdserve up: giving up: {gave_up}", file=sys.stderr, flush=True)
    print("stopping...", flush=True)
    code = cluster.stop()
    print("stopped" + ("" if code == 0 else f" (a node exited with {code})"), flush=True)
    return max(code, 1) if gave_up is not None else code


def _print_endpoints(cluster: Cluster, endpoints: list[str], out: TextIO) -> None:
    """The front door first (where there is one), then every decode node's own endpoint."""
    door, http = cluster.front_door_endpoint, cluster.http_endpoints
    if door is not None:
        print(f"endpoint: {door} (front door; decode nodes: {', '.join(endpoints)})", file=out)
        if cluster.front_door_http:
            nodes = ", ".join(http)
            print(f"HTTP (OpenAI API): {cluster.front_door_http}/v1 (nodes: {nodes})", file=out)
        return
    others = f" (all decode nodes: {', '.join(endpoints)})" if len(endpoints) > 1 else ""
    print(f"endpoint: {endpoints[0]}{others}", file=out)
    if http:
        more = f" (all: {', '.join(http)})" if len(http) > 1 else ""
        print(f"HTTP (OpenAI API): {http[0]}/v1{more}", file=out)


def _refused(nodes: list[NodeProcess]) -> bool:
    """Whether a node exited with 2 before it was ready: a node command that refuses to start
    (a port in use, a flag it rejects) has then said why, in one line on stderr."""
    for node in nodes:
        if node.ready.is_set() and not node.info:  # its stdout ended: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                if node.proc.wait(5) == 2:
                    return True
    return False


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
    tls = client_tls(a, "")
    params = from_args(SamplingParams, a, stop=tuple(a.stop))
    return _stream_to_stdout(a.target, a.prompt, params, timeout=a.timeout, tls=tls)


def _stream_to_stdout(
    target: str,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    timeout: float | None = None,
    tls: ClientTls | None = None,
    summary: IO[str] = sys.stderr,
) -> int:
    """Stream a completion's text as it arrives; then a summary line, to `summary`."""
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
            file=summary,
            flush=True,
        )
        return 0

    try:
        return asyncio.run(run())
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


BENCH_EXTRA = ("transformers", "accelerate")  # what the `bench` extra adds besides matplotlib


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[a.name])
    try:
        module.main(a.args)
    except ModuleNotFoundError as e:
        if e.name not in BENCH_EXTRA:
            raise
        # the baselines (transformers' generate) and the checkpoints they build are the
        # optional `bench` extra, like the plots
        print(
            f"pdserve bench {a.name} needs {e.name}, which is not installed: "
            "pip install 'pdserve[bench]'",
            file=sys.stderr,
        )
        return 2
    return 0


def cmd_build_kernels(a: argparse.Namespace) -> int:
    from shared.model.kernel_build import run as run_build

    return run_build(a)


def cmd_export_hf(a: argparse.Namespace) -> int:
    from pdserve.export_hf import run as run_export

    return run_export(a)


def cmd_proxy(a: argparse.Namespace) -> int:
    from pdserve.proxy_main import run as run_proxy

    return run_proxy(a)


def cmd_plan(a: argparse.Namespace) -> int:
    from pdserve.plan import run as run_plan

    return run_plan(a)


def cmd_prefill(a: argparse.Namespace) -> int:
    from pdserve.nodes import run_prefill

    return run_prefill(
        from_args(
            PrefillNodeConfig,
            a,
            engine=_engine_config(a, PREFILL_MAX_NUM_TOKENS),
            tls=_server_tls(a),
        )
    )


def _push_mode(a: argparse.Namespace) -> str:
    if a.whole_request_push and a.push not in (None, "whole"):
        raise SystemExit(f"--whole-request-push contradicts --push {a.push}")
    return "whole" if a.whole_request_push else a.push or "auto"


def cmd_decode(a: argparse.Namespace) -> int:
    from pdserve.nodes import run_decode

    return run_decode(
        from_args(
            DecodeNodeConfig,
            a,
            engine=_engine_config(a),
            prefill_targets=tuple(t.strip() for t in a.prefill.split(",") if t.strip()),
            ucx_bind_host=a.ucx_bind,
            push=_push_mode(a),
            tls=_server_tls(a),
            prefill_tls=client_tls(a, "prefill_"),
            colocated=a.command == "colocated",
        )
    )


COMMANDS = {
    "up": cmd_up,
    "generate": cmd_generate,
    "bench": cmd_bench,
    "export-hf": cmd_export_hf,
    "proxy": cmd_proxy,
    "plan": cmd_plan,
    "build-kernels": cmd_build_kernels,
}
# node commands: config errors exit 2
NODE_COMMANDS = {"prefill": cmd_prefill, "decode": cmd_decode, "colocated": cmd_decode}


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level)
    try:
        check_bound_ports(a)  # before anything slow starts
        if a.command in COMMANDS:
            return COMMANDS[a.command](a)
        return _run_node(a)
    except (PortInUse, KvPortInUse) as e:
        print(port_in_use_line(e), file=sys.stderr)
        return 2


def _run_node(a: argparse.Namespace) -> int:
    from shared.engine.runtime import cpu_threads

    # a colocated node is a decode node; `up` passes --otlp-traces-endpoint on to its nodes
    tracing.setup(
        "pdserve-prefill" if a.command == "prefill" else "pdserve-decode", a.otlp_traces_endpoint
    )
    try:
        cpu_threads.apply()  # torch's and the kernels' threads: the CPUs this process may use
        code = NODE_COMMANDS[a.command](a)
    except ValueError as e:
        print(f"pdserve {a.command}: invalid configuration: {e}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # the node stopped: export the spans still buffered
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """The node has stopped: drained, its pools checked, every endpoint and file closed, its
    spans exported. What the interpreter's own teardown of torch and UCX still does (about a
    second) frees nothing the OS does not, and whoever stops a node waits for it (an operator,
    `pdserve up` restarting it, a rolling update): skip it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
