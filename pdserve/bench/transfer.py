"""KV transfer latency and bandwidth: pdserve's push against its ceilings and peers, same run.

The KV of an N-token prompt (N = 16 .. 32k; the built-in `tiny` model's layout and a
Llama-3-8B-shaped one: 32 layers, 8 KV heads, head dim 128, bf16) goes from a 'prefill' process
to a 'decode' process through:

    pdserve_layerwise  KvSender -> KvReceiver as the prefill node pushes a CPU pool layer by
                       layer: per layer a header and a payload gathered straight from the pool
                       blocks and landed straight in the reserved blocks, 8 messages in flight
    pdserve_whole      the same blocks as ONE message for all layers (a whole-request push, or a
                       layer-wise push whose sender is behind: queued layers are coalesced)
    pdserve_packed     the same, every layer packed into a contiguous buffer first (the path
                       of CUDA pools)
    ucx_perftest       raw UCX ceiling: `ucx_perftest -t tag_bw -e` from the libucx wheel
    ucxx_contiguous    one contiguous ucxx message of the same bytes, no packing, no scatter
    nixl               NIXL (UCX backend) WRITE of the same per-block descriptors (skipped with
                       the reason when nixl cannot be imported)
    grpc               the naive baseline: the same blocks streamed over gRPC (4 MiB messages)
    memcpy             the physical ceiling: one copy of the same bytes in one process

p50/p99 latency and GB/s per size, and pdserve's ratio to each. Latency runs from the sender's
first action to the moment the receiver has the bytes in place (for pdserve: validated and
written into the reserved blocks); NIXL's end is the initiator seeing its WRITE complete.

    python -m pdserve.bench.transfer [--quick] [--netns] [--out bench_out]
    pdserve bench transfer [--netns] ...
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.support.net import NetPlan, loopback, netns_pair, netns_supported
from pdserve.bench.support.transfer_methods import (
    PERFTEST_RUNS,
    SizeRun,
    measure_idle,
    payload_bytes,
)
from pdserve.bench.support.util import (
    PeerProcess,
    child_env,
    environment,
    exit_on_sigterm,
    figure,
    human_bytes,
    load_average,
    mem_available_bytes,
    pyplot,
    ratio,
    write_json,
)
from pdserve.bench.transfer_targets import HEADLINE, WHOLE, print_summary, targets
from shared.kv.layout import KvLayout

SHAPES: dict[str, KvLayout] = {
    # the built-in tiny model as a CPU node holds it (float32)
    "tiny": KvLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"),
    "llama3-8b": KvLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"
    ),
}
FULL_TOKENS = [16, 64, 256, 1024, 4096, 16384, 32768]
QUICK_TOKENS = [16, 256]
METHODS = [
    "pdserve_layerwise",
    "pdserve_whole",
    "pdserve_packed",
    "ucx_perftest",
    "ucxx_contiguous",
    "nixl",
    "grpc",
    "memcpy",
]
# where a pdserve transfer spends its time (medians; the warm-up is left out)
# sender pool, receiver pool, a whole-request push's packed copy and the memcpy destination
# live at once: keep them inside this share of the memory available at start (the machine is
# shared; an out-of-memory kill could hit someone else's process)
MEMORY_SHARE = 0.6
COPIES = 4


# ---- plan ---------------------------------------------------------------------------------------
def iterations(nbytes: int, quick: bool) -> int:
    """Enough repeats for a p99 on small payloads, at least 5 on the largest (p99 of 5 is
    their max; the JSON says how many)."""
    if quick:
        return 3
    return int(min(50, max(5, (1 << 30) // max(1, nbytes))))


def nixl_status() -> str | None:
    """None when nixl imports (checked in a child: its UCX must not load in this process)."""
    if importlib.util.find_spec("nixl") is None:
        return "nixl is not installed (pip install nixl, beside the pinned CPU torch)"
    check = subprocess.run(
        [sys.executable, "-c", "import nixl._api"], capture_output=True, text=True, timeout=120
    )
    if check.returncode != 0:
        return f"nixl does not import: {check.stderr.strip().splitlines()[-1:]}"
    return None


# ---- driver -------------------------------------------------------------------------------------
def start_peers(
    plan: NetPlan, out: Path, profile: Path | None = None
) -> tuple[PeerProcess, PeerProcess]:
    """The two peers; with `profile`, each under cProfile, its stats written to
    profile/transfer_<role>.prof when it quits (read them with `python -m pstats`)."""

    def python(role: str) -> list[str]:
        run = [sys.executable]
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            run += ["-m", "cProfile", "-o", str(profile / f"transfer_{role}.prof")]
        return [*run, "-m", "pdserve.bench.peers.transfer_peer", "--role", role]

    recv = PeerProcess(
        "receiver",
        [*plan.receiver_prefix, *python("receiver"), "--host", plan.receiver_host],
        child_env(**plan.receiver_env),
        out / "logs" / f"transfer_{plan.name}_receiver.log",
    )
    try:
        send = PeerProcess(
            "sender",
            [*plan.sender_prefix, *python("sender")],
            child_env(**plan.sender_env),
            out / "logs" / f"transfer_{plan.name}_sender.log",
        )
    except BaseException:
        recv.close()
        raise
    return recv, send


def headline_ratios(methods: dict[str, Any], headline: str = HEADLINE) -> dict[str, float | None]:
    ours = methods.get(headline, {}).get("gbps_p50", 0.0)
    return {
        f"vs_{name}": ratio(ours, methods.get(name, {}).get("gbps_p50", 0.0))
        for name in METHODS
        if name != headline
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plot(result: dict[str, Any], out: Path) -> None:
    if pyplot() is None:
        return
    name = result["network"]["name"]
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    with figure(out / f"transfer_{name}.png", ncols=max(1, len(shapes)), width=6.5) as (_, axes):
        for ax, shape in zip(axes, shapes, strict=False):
            rows = [r for r in result["rows"] if r["shape"] == shape and "methods" in r]
            for method in METHODS:
                pts = [
                    (r["bytes"], r["methods"][method]["gbps_p50"])
                    for r in rows
                    if r["methods"].get(method, {}).get("gbps_p50")
                ]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    style = "-o" if method.startswith("pdserve") else "--."
                    ax.plot(xs, ys, style, label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("KV payload (bytes)")
            ax.set_ylabel("GB/s (p50)")
            ax.set_title(f"{shape} KV, {name}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke test)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument(
        "--netns", action="store_true", help="two network namespaces + veth (root; real TCP)"
    )
    parser.add_argument("--shapes", default=None, help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--tokens", default=None, help="comma list of prompt lengths")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--max-payload-mib", type=float, default=0, help="0: from the memory available"
    )
    parser.add_argument("--idle-seconds", type=float, default=0)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run both peers under cProfile, stats into this directory (where a push's time goes)",
    )
    a = parser.parse_args(argv)
    a.shapes = a.shapes.split(",") if a.shapes else (["tiny"] if a.quick else list(SHAPES))
    default_tokens = QUICK_TOKENS if a.quick else FULL_TOKENS
    a.tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else default_tokens
    a.methods = [m for m in a.methods.split(",") if m]
    unknown = sorted(set(a.methods) - set(METHODS) | set(a.shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown method/shape {unknown}")
    if a.netns and (why := netns_supported()):
        parser.error(f"--netns needs root and iproute2: {why}")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    exit_on_sigterm()
    load_at_start = load_average()
    available = mem_available_bytes()
    cap = int(a.max_payload_mib * 2**20) or int(available * MEMORY_SHARE / COPIES)
    nixl_skip = nixl_status() if "nixl" in a.methods else "not requested"
    if nixl_skip and "nixl" in a.methods:
        tqdm.write(f"NIXL skipped: {nixl_skip}")
    idle_seconds = a.idle_seconds or (1.0 if a.quick else 3.0)
    net = netns_pair() if a.netns else loopback()
    rows: list[dict[str, Any]] = []
    with net as plan:
        recv, send = start_peers(plan, a.out, a.profile)
        try:
            idle = measure_idle(recv, send, idle_seconds, SHAPES["tiny"])
            tqdm.write(
                f"idle receiver: {idle['receiver_idle_cpu_percent']:.2f}% of a core, "
                f"{idle['receiver_waiting_cpu_percent']:.2f}% with a transfer pending"
            )
            cases = [(s, t) for s in a.shapes for t in a.tokens]
            bar = tqdm(cases, desc=f"transfer ({plan.name})", unit="size")
            for shape, n in bar:
                args = (a.quick, cap, a.methods, nixl_skip, bar)
                rows.append(run_case(plan, recv, send, shape, n, *args))
        finally:
            send.close()
            recv.close()
    result = {
        "benchmark": "transfer",
        "network": {"name": plan.name, "description": plan.description},
        "environment": {**environment(), "cpu": cpu_model(), "cores": os.cpu_count()},
        "load_average": {"start": load_at_start, "end": load_average()},
        "memory": {
            "available_bytes_at_start": available,
            "payload_cap_bytes": cap,
            "rule": f"payload <= {MEMORY_SHARE:.0%} of available memory / {COPIES} (sender "
            "pool, receiver pool, a whole-request push's packed copy, memcpy destination)",
        },
        "nixl": nixl_skip or "measured",
        "latency_definition": "sender's first action -> bytes in place on the receiver "
        "(pdserve: validated and written into the reserved blocks); NIXL: initiator sees "
        "its WRITE complete",
        "idle": idle,
        "rows": rows,
    }
    result["targets"] = targets(rows, idle)
    result["targets"]["whole_request"] = targets(rows, idle, "ratios_whole")
    write_json(a.out / f"transfer_{plan.name}.json", result)
    plot(result, a.out)
    print_summary(result)
    return result


def run_case(
    plan: NetPlan,
    recv: PeerProcess,
    send: PeerProcess,
    shape: str,
    tokens: int,
    quick: bool,
    cap: int,
    methods: list[str],
    nixl_skip: str | None,
    bar: Any,
) -> dict[str, Any]:
    layout = SHAPES[shape]
    nbytes = payload_bytes(layout, tokens)
    row: dict[str, Any] = {"shape": shape, "tokens": tokens, "bytes": nbytes}
    if nbytes > cap:
        row["skipped"] = f"{human_bytes(nbytes)} exceeds the memory cap {human_bytes(cap)}"
        tqdm.write(f"{shape} {tokens} tokens: {row['skipped']}")
        return row
    iters = iterations(nbytes, quick)
    run = SizeRun(plan, recv, send, layout, tokens, iters, nixl_skip, 1 if quick else PERFTEST_RUNS)

    def progress(method: str) -> None:
        bar.set_postfix_str(f"{shape} {tokens} tok {human_bytes(nbytes)}: {method}")

    row.update(blocks=run.blocks, iterations=iters, methods=run.run(methods, progress))
    row["ratios"] = headline_ratios(row["methods"])
    row["ratios_whole"] = headline_ratios(row["methods"], WHOLE)
    for key, label in (("ratios", "layer-wise"), ("ratios_whole", "whole")):
        name = HEADLINE if key == "ratios" else WHOLE
        ours = row["methods"].get(name, {}).get("gbps_p50", 0)
        tqdm.write(
            f"{shape:>9} {tokens:>6} tok {human_bytes(nbytes):>9}: pdserve {label:>10} "
            f"{ours:6.2f} GB/s  "
            + "  ".join(
                f"{k[3:]} {v:.2f}x"
                for k, v in row[key].items()
                if v is not None and not k.startswith("vs_pdserve")
            )
        )
    return row


if __name__ == "__main__":
    main()
