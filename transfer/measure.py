"""Measure 16 MiB transfers (one layer-sized KV message) in each progress mode compared.

    python -m transfer.measure [--mib 16] [--iters 20] [--modes kv,adaptive,blocking,...]

Every mode runs in two fresh processes on this host (receiver, sender) and reports GB/s
(sender pushes `iters` messages back to back, each awaited; the first is warm-up) and the
receiver's idle CPU while a peer is connected and a receive is expected but nothing arrives.

modes:
  kv             this package end to end: KvSender.send_blocks (payload gathered from the pool)
                 -> KvReceiver (header validated, payload received into the reserved blocks);
                 1-layer layout, one 16 MiB payload per transfer
  adaptive       this package's UcxWorker, raw tagged 16 MiB messages (probe + receive)
  thread, thread+future, polling, blocking
                 ucxx's async API (ep.send / ep.recv) in that progress mode

The numbers recorded when the progress design was chosen, and the choice, are in the
docstring of transfer/worker.py. The machine must be otherwise idle: both peers poll while a
message moves, so other jobs on the same cores distort the result by 10x or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

RESULT = "MEASURE-RESULT "
PORT = "MEASURE-PORT "
IDLE_S = 2.0
ALL_MODES = ["kv", "adaptive", "thread", "thread+future", "polling", "blocking"]


def _idle_cpu_percent(started_cpu: float, started_wall: float) -> float:
    return 100 * (time.process_time() - started_cpu) / (time.monotonic() - started_wall)


def _emit(prefix: str, obj: Any) -> None:
    print(prefix + json.dumps(obj), flush=True)


def _emit_rate(nbytes: int, seconds: list[float]) -> None:
    """Median and best per-message rate, first message (connection warm-up) excluded: medians
    resist the other jobs sharing this machine better than a total does."""
    steady = sorted(seconds[1:])
    median = steady[len(steady) // 2]
    _emit(RESULT, {"gbps": nbytes / median / 1e9, "best_gbps": nbytes / steady[0] / 1e9})


# ---- this package -------------------------------------------------------------------------------
def _kv_layout(nbytes: int) -> Any:
    from shared.engine.kv_cache import KvLayout

    # 64 KiB blocks (block_size 16, 8 kv heads x 128, bf16): nbytes / 64 KiB blocks per layer
    layout = KvLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    return layout, nbytes // layout.block_bytes_per_layer


async def _kv_server(nbytes: int, iters: int) -> None:
    from shared.engine.kv_cache import allocate_kv_pool
    from transfer.ucx import KvReceiver

    layout, blocks = _kv_layout(nbytes)
    receiver = KvReceiver(allocate_kv_pool(layout, blocks, "cpu"), layout)
    await receiver.start()
    dests = [receiver.expect(f"m{i}", list(range(blocks))) for i in range(iters)]
    _emit(PORT, {"dests": [_dest_json(d) for d in dests]})
    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.sleep(IDLE_S)
    idle = _idle_cpu_percent(cpu, wall)
    for d in dests:
        await receiver.wait(d.transfer_id, 60)
    _emit(RESULT, {"idle_cpu": idle})
    await receiver.close()


async def _kv_client(info: dict[str, Any]) -> None:
    import torch

    from shared.engine.kv_cache import allocate_kv_pool
    from transfer.protocol import TransferDestination
    from transfer.ucx import KvSender

    dests = [
        TransferDestination(**{**d, "token": bytes.fromhex(d["token"])}) for d in info["dests"]
    ]
    layout, blocks = _kv_layout(info["nbytes"])
    pool = allocate_kv_pool(layout, blocks, "cpu")
    pool.copy_(torch.randn(pool.shape))
    sender = KvSender(layout)
    await asyncio.sleep(IDLE_S + 0.5)
    times = []
    for dest in dests:
        started = time.perf_counter()
        await sender.send_blocks(dest, 0, dest.block_ids, pool, dest.block_ids)
        times.append(time.perf_counter() - started)
    _emit_rate(info["nbytes"], times)
    await sender.close()


def _dest_json(d: Any) -> dict[str, Any]:
    return {
        "address": d.address,
        "transfer_id": d.transfer_id,
        "token": d.token.hex(),
        "block_ids": list(d.block_ids),
        "layout_fingerprint": d.layout_fingerprint,
    }


async def _adaptive_server(nbytes: int, iters: int) -> None:
    import numpy as np

    from transfer.worker import UcxWorker

    engine = UcxWorker()
    endpoints: list[Any] = []
    listener = engine.listen("127.0.0.1", 0, endpoints.append, lambda ep: None)
    probes: asyncio.Queue[Any] = asyncio.Queue()

    def drain() -> None:
        while (probe := engine.probe()) is not None:
            probes.put_nowait(probe)

    engine.add_hook(drain)
    _emit(PORT, {"port": listener.port})
    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.sleep(IDLE_S)
    idle = _idle_cpu_percent(cpu, wall)
    buf = np.empty(nbytes, dtype=np.uint8)
    for _ in range(iters):
        await engine.recv_probed(await probes.get(), buf)
    _emit(RESULT, {"idle_cpu": idle})
    await asyncio.wait([engine.close_endpoint(ep) for ep in endpoints], timeout=2)
    listener.destroy()
    engine.close()


async def _adaptive_client(info: dict[str, Any]) -> None:
    import numpy as np

    from transfer.worker import UcxWorker

    engine = UcxWorker()
    endpoint = engine.connect("127.0.0.1", info["port"])
    buf = np.ones(info["nbytes"], dtype=np.uint8)
    await asyncio.sleep(IDLE_S + 0.5)
    times = []
    for _ in range(info["iters"]):
        started = time.perf_counter()
        await engine.send(endpoint, buf, 7)
        times.append(time.perf_counter() - started)
    _emit_rate(info["nbytes"], times)
    await asyncio.wait([engine.close_endpoint(endpoint)], timeout=2)
    engine.close()


# ---- ucxx's async API ---------------------------------------------------------------------------
def _ucxx_init(mode: str) -> Any:
    import ucxx

    ucxx.init(progress_mode=mode.removesuffix("+future"), enable_python_future="future" in mode)
    return ucxx


async def _ucxx_server(mode: str, nbytes: int, iters: int) -> None:
    import numpy as np

    ucxx = _ucxx_init(mode)
    result: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()

    async def handler(ep: Any) -> None:
        # Idle with a receive posted, which is how this API waits for a message.
        cpu, wall = time.process_time(), time.monotonic()
        buf = np.empty(nbytes, dtype=np.uint8)
        await ep.recv(buf, tag=7, force_tag=True)
        idle = _idle_cpu_percent(cpu, wall)
        for _ in range(iters - 1):
            await ep.recv(buf, tag=7, force_tag=True)
        await ep.send(np.zeros(1, dtype=np.uint8), tag=8, force_tag=True)
        result.set_result({"idle_cpu": idle})

    listener = ucxx.create_listener(handler, port=0)
    _emit(PORT, {"port": listener.port})
    _emit(RESULT, await result)
    await asyncio.sleep(0.5)  # let the handler return before the listener goes
    listener.close()
    ucxx.stop_notifier_thread()


async def _ucxx_client(mode: str, info: dict[str, Any]) -> None:
    import numpy as np

    ucxx = _ucxx_init(mode)
    ep = await ucxx.create_endpoint("127.0.0.1", info["port"])
    buf = np.ones(info["nbytes"], dtype=np.uint8)
    await asyncio.sleep(IDLE_S)
    times = []
    for _ in range(info["iters"]):
        started = time.perf_counter()
        await ep.send(buf, tag=7, force_tag=True)
        times.append(time.perf_counter() - started)
    _emit_rate(info["nbytes"], times)
    await ep.recv(np.empty(1, dtype=np.uint8), tag=8, force_tag=True)
    await ep.close()
    ucxx.stop_notifier_thread()


# ---- orchestration ------------------------------------------------------------------------------
def _role_main(args: argparse.Namespace) -> None:
    from transfer.env import configure_ucx_env

    configure_ucx_env()
    nbytes = args.mib << 20
    mode = args.mode
    if args.role == "server":
        if mode == "kv":
            coro = _kv_server(nbytes, args.iters)
        elif mode == "adaptive":
            coro = _adaptive_server(nbytes, args.iters)
        else:
            coro = _ucxx_server(mode, nbytes, args.iters)
    else:
        info = {**json.loads(args.info), "nbytes": nbytes, "iters": args.iters}
        if mode == "kv":
            coro = _kv_client(info)
        elif mode == "adaptive":
            coro = _adaptive_client(info)
        else:
            coro = _ucxx_client(mode, info)
    asyncio.run(coro)


def _run_mode(mode: str, mib: int, iters: int) -> dict[str, Any]:
    base = [sys.executable, "-m", "transfer.measure", "--mode", mode, "--mib", str(mib)]
    base += ["--iters", str(iters)]
    server = subprocess.Popen([*base, "--role", "server"], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        info = _read_line(server, PORT)
        client = subprocess.Popen(
            [*base, "--role", "client", "--info", json.dumps(info)],
            stdout=subprocess.PIPE,
            text=True,
        )
        result = {**_read_line(client, RESULT), **_read_line(server, RESULT)}
        client.wait(timeout=60)
        server.wait(timeout=30)
        return result
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _read_line(proc: subprocess.Popen, prefix: str) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    raise RuntimeError(f"measure process exited ({proc.wait()}) before {prefix.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        _role_main(args)
        return
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    print(f"{args.mib} MiB messages, {args.iters} per mode (first is warm-up), same host")
    print(f"{'mode':<15}{'median GB/s':>12}{'best GB/s':>11}{'idle CPU %':>12}")
    for mode in args.modes.split(","):
        try:
            r = _run_mode(mode, args.mib, args.iters)
            line = f"{mode:<15}{r['gbps']:>12.2f}{r['best_gbps']:>11.2f}{r['idle_cpu']:>12.1f}"
            print(line, flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{mode:<15}  failed: {e}", flush=True)


if __name__ == "__main__":
    main()
