"""16 MiB transfers (one layer-sized KV message) in each UCX progress mode that was compared when
`transfer.worker.UcxWorker` was designed; the numbers and the choice are in docs/performance.md.

    python -m pdserve.bench.progress_modes [--mib 16] [--iters 20] [--modes kv,adaptive,...]

Every mode runs in two fresh transfer peers on this host (`pdserve.bench.peers.transfer_peer`) and
reports GB/s (the sender pushes `iters` messages back to back, each awaited; the first is
warm-up; median and best per message) and the receiver's CPU while a peer is connected and a
message is expected but nothing arrives.

modes:
  kv             pdserve end to end: KvPush.send of pool blocks (gathered by UCX) -> KvReceiver
                 (header validated, payload received into the reserved blocks); 1-layer layout
  adaptive       UcxWorker, raw tagged messages (probe + receive)
  thread, thread+future, polling, blocking
                 ucxx's async API (ep.send / ep.recv) in that progress mode

The machine must be otherwise idle: both peers poll while a message moves, so other jobs on the
same cores distort the result by 10x or more.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.support.util import PeerError, PeerProcess, child_env
from shared.kv.layout import KvLayout

IDLE_S = 2.0
HOST = "127.0.0.1"
UCXX_MODES = ["thread", "thread+future", "polling", "blocking"]
ALL_MODES = ["kv", "adaptive", *UCXX_MODES]
# 64 KiB blocks (block_size 16, 8 kv heads x 128, bf16): a message is nbytes / 64 KiB blocks
LAYOUT = KvLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def _rate(nbytes: int, seconds: list[float]) -> dict[str, float]:
    """Median and best per-message rate, first message (connection warm-up) excluded: medians
    resist the other jobs sharing this machine better than a total does."""
    steady = sorted(seconds[1:])
    return {"gbps": nbytes / steady[len(steady) // 2] / 1e9, "best_gbps": nbytes / steady[0] / 1e9}


def _setup(recv: PeerProcess, send: PeerProcess, nbytes: int) -> list[int]:
    blocks = nbytes // LAYOUT.block_bytes_per_layer
    layout = dataclasses.asdict(LAYOUT)
    recv.call("setup", layout=layout, num_blocks=blocks)
    send.call("setup", layout=layout, num_blocks=blocks)
    return list(range(blocks))


def _kv(recv: PeerProcess, send: PeerProcess, nbytes: int, iters: int) -> dict[str, float]:
    ids = _setup(recv, send, nbytes)
    idle = recv.call("idle", seconds=IDLE_S, expect=True)["cpu_percent"]
    seconds = []
    for _ in range(iters):
        dest = recv.call("expect", block_ids=ids)["dest"]
        sent = send.call("send_kv", dest=dest, src_ids=ids, mode="whole")
        recv.call("result", transfer_id=dest["transfer_id"])
        seconds.append(sent["sent"] - sent["start"])
    return {**_rate(nbytes, seconds), "idle_cpu": idle}


def _adaptive(recv: PeerProcess, send: PeerProcess, nbytes: int, iters: int) -> dict[str, float]:
    _setup(recv, send, nbytes)
    port = recv.call("raw_start")["port"]
    seconds = []
    for key in range(iters):
        recv.call("raw_expect", key=key)
        sent = send.call("send_raw", host=HOST, port=port)
        recv.call("raw_result", key=key)
        seconds.append(sent["sent"] - sent["start"])
        if key == 0:  # connected now: a peer is there, nothing arrives
            idle = recv.call("idle", seconds=IDLE_S, expect=False)["cpu_percent"]
    return {**_rate(nbytes, seconds), "idle_cpu": idle}


def _ucxx(mode: str) -> Callable[[PeerProcess, PeerProcess, int, int], dict[str, float]]:
    def run(recv: PeerProcess, send: PeerProcess, nbytes: int, iters: int) -> dict[str, float]:
        port = recv.call("ucxx_listen", mode=mode, nbytes=nbytes, iters=iters)["port"]
        args = {"mode": mode, "host": HOST, "port": port, "nbytes": nbytes, "iters": iters}
        sent = send.call("ucxx_send", wait_s=IDLE_S, **args)
        return {**_rate(nbytes, sent["seconds"]), **recv.call("ucxx_result")}

    return run


MODES = {"kv": _kv, "adaptive": _adaptive, **{m: _ucxx(m) for m in UCXX_MODES}}


def run_mode(mode: str, mib: int, iters: int, logs: Path) -> dict[str, Any]:
    python = [sys.executable, "-m", "pdserve.bench.peers.transfer_peer", "--host", HOST]
    recv = PeerProcess(
        "receiver", [*python, "--role", "receiver"], child_env(), logs / "receiver.log"
    )
    try:
        send = PeerProcess("sender", [*python, "--role", "sender"], child_env(), logs / "send.log")
        try:
            return MODES[mode](recv, send, mib << 20, iters)
        finally:
            send.close()
    finally:
        recv.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    args = parser.parse_args(argv)
    print(f"{args.mib} MiB messages, {args.iters} per mode (first is warm-up), same host")
    print(f"{'mode':<15}{'median GB/s':>12}{'best GB/s':>11}{'idle CPU %':>12}")
    with tempfile.TemporaryDirectory() as logs:
        for mode in args.modes.split(","):
            try:
                r = run_mode(mode, args.mib, args.iters, Path(logs) / mode)
                line = f"{mode:<15}{r['gbps']:>12.2f}{r['best_gbps']:>11.2f}{r['idle_cpu']:>12.1f}"
                print(line, flush=True)
            except PeerError as e:
                print(f"{mode:<15}  failed: {e}", flush=True)


if __name__ == "__main__":
    main()
