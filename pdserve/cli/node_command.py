"""`pdserve prefill`, `decode` and `colocated`: a node's config from its flags, validated, then
the node, in this process until it stops. The only commands that import torch (through the
configs' device and dtype checks and the engine they start)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from decode_node.config import DecodeNodeConfig
from pdserve.cli.flags import client_tls, from_args, server_tls
from prefill_node.config import PREFILL_MAX_NUM_TOKENS, PrefillNodeConfig
from shared.engine.config import EngineConfig
from shared.engine.speculative.config import SpeculativeConfig
from shared.serving import tracing


def speculative_config(text: str) -> SpeculativeConfig | None:
    """`--speculative-config`'s JSON (ValueError naming what is wrong); '': off."""
    return SpeculativeConfig.from_json(text) if text else None


def engine_config(a: argparse.Namespace, step_tokens: int | None = None) -> EngineConfig:
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


def push_mode(a: argparse.Namespace) -> str:
    if a.whole_request_push and a.push not in (None, "whole"):
        raise SystemExit(f"--whole-request-push contradicts --push {a.push}")
    return "whole" if a.whole_request_push else a.push or "auto"


def prefill_config(a: argparse.Namespace) -> PrefillNodeConfig:
    engine = engine_config(a, PREFILL_MAX_NUM_TOKENS)
    encoders = tuple(t.strip() for t in a.encoder.split(",") if t.strip())
    return from_args(
        PrefillNodeConfig,
        a,
        engine=engine,
        tls=server_tls(a),
        encoder_targets=encoders,
        ucx_bind_host=a.ucx_bind,
        encoder_landing_bytes=a.encoder_landing_mb << 20,
        encoder_tls=client_tls(a, "encoder_"),
    )


def decode_config(a: argparse.Namespace) -> DecodeNodeConfig:
    return from_args(
        DecodeNodeConfig,
        a,
        engine=engine_config(a),
        prefill_targets=tuple(t.strip() for t in a.prefill.split(",") if t.strip()),
        ucx_bind_host=a.ucx_bind,
        push=push_mode(a),
        tls=server_tls(a),
        prefill_tls=client_tls(a, "prefill_"),
        colocated=a.command == "colocated",
        allowed_media_domains=tuple(a.allowed_media_domains),
    )


def run_node(a: argparse.Namespace) -> int:
    """Config errors exit 2 with one line; a node that ran exits without the interpreter's
    teardown (`_exit_now`)."""
    from pdserve.nodes import run_decode, run_prefill
    from shared.engine.runtime import cpu_threads

    # a colocated node is a decode node; `up` passes --otlp-traces-endpoint on to its nodes
    tracing.setup(
        "pdserve-prefill" if a.command == "prefill" else "pdserve-decode", a.otlp_traces_endpoint
    )
    try:
        cpu_threads.apply()  # torch's and the kernels' threads: the CPUs this process may use
        if a.command == "prefill":
            code = run_prefill(prefill_config(a))
        else:
            code = run_decode(decode_config(a))
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
