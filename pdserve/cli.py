"""The `pdserve` command: up, prefill, decode, generate."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
from typing import Any, TypeVar

from decode_node.config import DecodeNodeConfig
from pdserve.cli_args import _engine_args as _engine_args  # re-export: pdserve/bench/peers
from pdserve.cli_args import build_parser
from prefill_node.config import PREFILL_MAX_NUM_TOKENS, PrefillNodeConfig
from shared.engine.config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.serving.tls import ClientTls, ServerTls

__all__ = ["BENCHMARKS", "build_parser", "from_args", "main", "run_prompt"]

T = TypeVar("T")


def _server_tls(a: argparse.Namespace) -> ServerTls | None:
    if not a.tls_cert and not a.tls_key:
        return None
    return ServerTls(a.tls_cert, a.tls_key, a.tls_client_ca)


def client_tls(a: argparse.Namespace, prefix: str) -> ClientTls | None:
    """From `cli_args.client_tls_args`' flags; None (plaintext) without a CA."""
    ca, cert, key = (getattr(a, f"{prefix}tls_{part}") for part in ("ca", "cert", "key"))
    return ClientTls(ca, cert, key) if ca else None


def from_args(cls: type[T], a: argparse.Namespace, **overrides: Any) -> T:
    """A config dataclass from the flags named after its fields, plus `overrides` for the
    rest: each flag is mapped once, where it is declared (`cli_args`)."""
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)}
    return cls(**{**given, **overrides})


def _engine_config(a: argparse.Namespace, step_tokens: int | None = None) -> EngineConfig:
    """`step_tokens`: the role's step budget when --max-num-tokens is 0 (None: the engine's)."""
    budget = a.max_num_tokens or step_tokens or EngineConfig.max_num_tokens
    return from_args(
        EngineConfig,
        a,
        kv_cache_memory_mb=a.kv_cache_mb,
        enable_prefix_caching=not a.no_prefix_caching,
        max_num_tokens=budget,
    )


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
    "transfer": "pdserve.bench.transfer",
    "serve": "pdserve.bench.serve",
    "ttft": "pdserve.bench.ttft",
    "engine": "pdserve.bench.engine",
    "roofline": "pdserve.bench.roofline",
    "peer": "pdserve.bench.peer",
}


def cmd_bench(a: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[a.name])
    module.main(a.args)
    return 0


def cmd_export_hf(a: argparse.Namespace) -> int:
    from pdserve.export_hf import run as run_export

    return run_export(a)


def cmd_proxy(a: argparse.Namespace) -> int:
    from pdserve.proxy import run as run_proxy

    return run_proxy(a)


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
}
# node commands: log setup, config errors exit 2
NODE_COMMANDS = {"prefill": cmd_prefill, "decode": cmd_decode, "colocated": cmd_decode}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command in COMMANDS:
        return COMMANDS[a.command](a)
    from pdserve.nodes import setup_logging

    setup_logging(a.log_level)
    try:
        return NODE_COMMANDS[a.command](a)
    except ValueError as e:
        print(f"pdserve {a.command}: invalid configuration: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
