"""`pdserve up`: a local cluster (prefill and decode node processes, a front door when asked),
supervised until Ctrl-C or SIGTERM; with `--run`, one question answered on stdout, then stop."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, TextIO

from pdserve.bound_ports import up_front_door, up_ports
from pdserve.cli.cluster_args import node_argv
from pdserve.cli.generate_command import stream_to_stdout
from shared.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.cluster import Cluster, NodeProcess


def cmd_up(a: argparse.Namespace) -> int:
    """Without --run, what it says goes to stdout; with --run, only the answer and its summary
    line do (the rest goes to stderr)."""
    from pdserve.supervisor import RestartPolicy, Supervisor

    prompt: str | list[int] | None = None
    if a.run is not None:
        try:
            prompt = run_prompt(a.model, a.run)
        except (ValueError, OSError) as e:
            print(f"pdserve up: model {a.model!r}: {e}", file=sys.stderr)
            return 2
    out = sys.stdout if prompt is None else sys.stderr
    cluster = _cluster(a)
    stop = False
    gave_up: str | None = None  # why the supervisor stopped restarting nodes

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        endpoints = cluster.start()
        print(
            f"pdserve is up: {_roles(a)}, model {a.model}",
            file=out,
        )
        _print_endpoints(cluster, endpoints, out)
        if prompt is not None:
            params = SamplingParams(max_tokens=a.max_tokens)
            code = stream_to_stdout(endpoints[0], prompt, params, summary=sys.stdout)
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


def _cluster(a: argparse.Namespace) -> Cluster:
    from pdserve.cluster import Cluster

    port, http_port = up_ports(a)
    return Cluster(
        a.model,
        a.prefill,
        a.decode,
        port,
        [],
        http_port=http_port,
        front_door=up_front_door(a),
        prefill_extra=node_argv(a, "prefill"),
        decode_extra=node_argv(a, "decode"),
        num_encode=a.encode,
        # an encoder's tower computes as the prefill nodes' does: in their dtype
        encode_extra=[] if a.dtype == "auto" else ["--dtype", a.dtype],
    )


def _roles(a: argparse.Namespace) -> str:
    encoders = f"{a.encode} encoder + " if a.encode else ""
    return f"{encoders}{a.prefill} prefill + {a.decode} decode node(s)"
