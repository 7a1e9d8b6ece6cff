"""The methods `pdserve bench transfer` times for one (KV shape, prompt length), each driving the
two transfer peers (`pdserve.bench.peers.transfer_peer`), and the idle-CPU reading."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.bench.peers.baselines import GRPC_CHUNK
from pdserve.bench.support.net import NetPlan, perftest
from pdserve.bench.support.util import PeerError, PeerProcess, summarize
from shared.cdiv import cdiv
from shared.kv.layout import KvLayout

PDSERVE_PARTS = ["sender_pack", "sender_awaiting_sends", "after_last_send"]
PERFTEST_MAX_MESSAGE = 16 << 20  # larger messages with a full window thrash UCX (measured)
PERFTEST_RUNS = 3


def payload_bytes(layout: KvLayout, tokens: int) -> int:
    return layout.payload_bytes(layout.num_layers, cdiv(tokens, layout.block_size))


def _result(nbytes: int, latencies: list[float], correct: bool | None) -> dict[str, Any]:
    stats = summarize(latencies)
    return {
        "latency_s": stats,
        "gbps_p50": nbytes / stats["p50"] / 1e9,
        "gbps_p99": nbytes / stats["p99"] / 1e9,
        "correct": correct,
    }


class SizeRun:
    """Every method for one (shape, prompt length). The timed iterations go round-robin over
    the methods, so a neighbour's load on this shared machine hits all of them alike and the
    ratios stay fair; each method's first transfer is a warm-up (connection set-up, page
    faults) after which the receiver checks that every block landed where it belongs."""

    def __init__(
        self,
        plan: NetPlan,
        recv: PeerProcess,
        send: PeerProcess,
        layout: KvLayout,
        tokens: int,
        iters: int,
        nixl_skip: str | None,
        perftest_runs: int = PERFTEST_RUNS,
    ):
        self.plan, self.recv, self.send = plan, recv, send
        self.layout, self.tokens, self.iters = layout, tokens, iters
        self.blocks = cdiv(tokens, layout.block_size)
        self.nbytes = payload_bytes(layout, tokens)
        self.src = list(range(self.blocks))
        # the decode node's reserved blocks lie scattered in its pool: a fixed shuffle
        self.dst = [int(b) for b in np.random.default_rng(tokens).permutation(self.blocks)]
        self.nixl_skip = nixl_skip
        self._keys = iter(range(1 << 62))
        self.runs = perftest_runs
        self.extras: dict[str, dict[str, Any]] = {
            "pdserve_layerwise": {},
            "pdserve_whole": {},
            "pdserve_packed": {},
            "ucxx_contiguous": {"messages_per_transfer": 1},
            "grpc": {"messages_per_transfer": cdiv(self.nbytes, GRPC_CHUNK)},
        }

    def run(self, methods: list[str], progress: Callable[[str], None]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "ucx_perftest" in methods:  # its own processes, before the peers hold two pools
            progress("ucx_perftest")
            out["ucx_perftest"] = self._guard("ucx_perftest", self.ucx_perftest)
        self.recv.call("setup", layout=asdict(self.layout), num_blocks=self.blocks)
        self.send.call("setup", layout=asdict(self.layout), num_blocks=self.blocks)
        try:
            timed: dict[str, Callable[[], float]] = {}
            for name in methods:
                if name in out:
                    continue
                progress(f"{name} warm-up")
                prepared = self._guard(name, getattr(self, "prepare_" + name))
                if callable(prepared):
                    timed[name] = prepared
                else:
                    out[name] = prepared
            progress(f"{len(timed)} methods x {self.iters}")
            samples = self._round_robin(timed, out)
        finally:
            self.recv.call("free")
            self.send.call("free")
        for extra in self.extras.values():
            if "breakdown_p50_s" in extra:  # lists of samples, the warm-up first
                parts = extra["breakdown_p50_s"].items()
                extra["breakdown_p50_s"] = {k: float(np.median(v[1:] or v)) for k, v in parts if v}
        for name, latencies in samples.items():
            verified = None if name == "memcpy" else True  # _warm raised otherwise
            out[name] = {**_result(self.nbytes, latencies, verified), **self.extras.get(name, {})}
        return out

    def _round_robin(
        self, timed: dict[str, Callable[[], float]], out: dict[str, Any]
    ) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(self.iters):
            for name, once in list(timed.items()):
                try:
                    samples[name].append(once())
                except (PeerError, RuntimeError) as e:
                    tqdm.write(f"  {name} failed: {e}")
                    out[name] = {"error": str(e)}
                    del timed[name], samples[name]
        return samples

    def _guard(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (PeerError, RuntimeError, subprocess.TimeoutExpired) as e:
            tqdm.write(f"  {name} failed: {e}")
            return {"error": str(e)}

    def _warm(self, once: Callable[[], float], identity: bool = False) -> Callable[[], float]:
        """Zero the receiver's pool, run one transfer, check where every block landed."""
        self.recv.call("zero")
        once()
        dst = self.src if identity else self.dst
        if not self.recv.call("verify", src_ids=self.src, dst_ids=dst)["correct"]:
            raise RuntimeError("blocks did not land where they belong")
        return once

    # -- the ceiling that runs in its own processes
    def ucx_perftest(self) -> dict[str, Any]:
        """`perftest_runs` runs of ucx_perftest (each a separate pair of processes, so they
        cannot join the round-robin); the median run's bandwidth is the ceiling."""
        message = min(self.nbytes, PERFTEST_MAX_MESSAGE)
        per_payload = cdiv(self.nbytes, message)
        iters = max(self.iters * per_payload, 20)
        timeout = 120 + self.nbytes * iters / 2e8
        runs = [perftest(self.plan, message, iters, timeout)["gbps"] for _ in range(self.runs)]
        gbps = float(np.median(runs))
        return {
            "latency_s": summarize([self.nbytes / (g * 1e9) for g in runs]),
            "gbps_p50": gbps,
            "gbps_p99": min(runs),
            "gbps_runs": runs,
            "message_bytes": message,
            "messages_per_run": iters,
            "note": "bandwidth of whole runs (a window of outstanding sends), median of "
            f"{len(runs)} runs; latency is payload / bandwidth",
            "correct": None,
        }

    # -- methods timed round-robin: prepare_X returns the function that times one transfer
    def prepare_memcpy(self) -> Callable[[], float]:
        def once() -> float:
            return float(self.send.call("memcpy")["seconds"])  # the sender's pool, one core

        once()
        return once

    def _prepare_pdserve(self, name: str, mode: str) -> Callable[[], float]:
        parts: dict[str, list[float]] = {k: [] for k in PDSERVE_PARTS}
        extra = self.extras[name]
        extra["breakdown_p50_s"] = parts  # medians replace the lists at the end

        def once() -> float:
            dest = self.recv.call("expect", block_ids=self.dst)["dest"]
            sent = self.send.call("send_kv", dest=dest, src_ids=self.src, mode=mode)
            landed = self.recv.call("result", transfer_id=dest["transfer_id"])
            # KV messages as they landed (each a header and a payload), and the coalescing
            # size the sender had measured by then
            extra["messages_per_transfer"] = landed["messages"]
            extra["min_message_bytes"] = sent["min_message_bytes"]
            parts["sender_pack"].append(sent["pack_s"])
            parts["sender_awaiting_sends"].append(sent["send_s"])
            parts["after_last_send"].append(landed["end"] - sent["sent"])
            return landed["end"] - sent["start"]

        return self._warm(once)

    def prepare_pdserve_layerwise(self) -> Callable[[], float]:
        return self._prepare_pdserve("pdserve_layerwise", "layerwise")

    def prepare_pdserve_whole(self) -> Callable[[], float]:
        return self._prepare_pdserve("pdserve_whole", "whole")

    def prepare_pdserve_packed(self) -> Callable[[], float]:
        return self._prepare_pdserve("pdserve_packed", "packed")

    def prepare_ucxx_contiguous(self) -> Callable[[], float]:
        port = self.recv.call("raw_start")["port"]

        def once() -> float:
            key = next(self._keys)
            self.recv.call("raw_expect", key=key)
            sent = self.send.call("send_raw", host=self.plan.receiver_host, port=port)
            return self.recv.call("raw_result", key=key)["end"] - sent["start"]

        return self._warm(once, identity=True)  # the pool as one message: block b lands in b

    def prepare_grpc(self) -> Callable[[], float]:
        address = f"{self.plan.receiver_host}:{self.recv.call('grpc_start')['port']}"

        def once() -> float:
            r = self.send.call("send_grpc", address=address, src_ids=self.src, dst_ids=self.dst)
            return r["end"] - r["start"]

        return self._warm(once)

    def prepare_nixl(self) -> Callable[[], float] | dict[str, Any]:
        if self.nixl_skip:
            return {"skipped": self.nixl_skip}
        info = self.recv.call("nixl_start")
        self.extras["nixl"] = self.send.call(
            "nixl_prepare",
            metadata=info["metadata"],
            base=info["base"],
            src_ids=self.src,
            dst_ids=self.dst,
        )
        self.extras["nixl"].pop("ok", None)

        def once() -> float:
            tag = f"x{next(self._keys)}"
            self.recv.call("nixl_expect", tag=tag)
            r = self.send.call("nixl_send", tag=tag)
            self.recv.call("nixl_result", tag=tag)  # its notification arrived too
            return r["end"] - r["start"]

        return self._warm(once)


# ---- idle CPU -----------------------------------------------------------------------------------
def measure_idle(
    recv: PeerProcess, send: PeerProcess, seconds: float, layout: KvLayout
) -> dict[str, float]:
    """A started receiver with a connected sender and nothing in flight, then with one transfer
    registered and waited for that never comes (a decode node waiting on a prefill)."""
    recv.call("setup", layout=asdict(layout), num_blocks=4)
    send.call("setup", layout=asdict(layout), num_blocks=4)
    try:
        dest = recv.call("expect", block_ids=[0, 1])["dest"]
        send.call("send_kv", dest=dest, src_ids=[0, 1], mode="layerwise")
        recv.call("result", transfer_id=dest["transfer_id"])
        idle = recv.call("idle", seconds=seconds, expect=False)["cpu_percent"]
        waiting = recv.call("idle", seconds=seconds, expect=True)["cpu_percent"]
    finally:
        recv.call("free")
        send.call("free")
    return {
        "seconds": seconds,
        "receiver_idle_cpu_percent": idle,
        "receiver_waiting_cpu_percent": waiting,
    }
