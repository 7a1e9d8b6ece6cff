"""Where the two sides of the transfer benchmark run, and the raw-UCX ceiling (`ucx_perftest`).

`loopback()`: both sides in this network namespace; UCX picks its transports itself (shared
memory between processes of one host). `netns_pair()`: two network namespaces joined by a veth
pair with a private /30, so the bytes cross a real TCP stack as between two hosts; UCX is held
to tcp on the veth device (namespaces do not separate System V shared memory, so UCX would
otherwise still use it). The namespaces are deleted however the run ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.support.util import kill_group

NETNS_SUBNET = ("10.213.0.1", "10.213.0.2", 30)  # receiver, sender, prefix length


@dataclass
class NetPlan:
    name: str  # "loopback" or "netns"
    receiver_host: str  # where the sender reaches the receiver
    receiver_prefix: list[str] = field(default_factory=list)  # command prefix (ip netns exec)
    sender_prefix: list[str] = field(default_factory=list)
    receiver_env: dict[str, str] = field(default_factory=dict)  # UCX settings per side
    sender_env: dict[str, str] = field(default_factory=dict)
    description: str = ""


@contextlib.contextmanager
def loopback() -> Iterator[NetPlan]:
    yield NetPlan(
        "loopback",
        "127.0.0.1",
        description="both sides on this host's loopback; UCX chooses (shared memory)",
    )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def netns_pair() -> Iterator[NetPlan]:
    tag = str(os.getpid() % 100000)
    ns_r, ns_s = f"pdb{tag}r", f"pdb{tag}s"
    dev_r, dev_s = f"pdv{tag}r", f"pdv{tag}s"  # interface names: 15 characters at most
    addr_r, addr_s, prefix = NETNS_SUBNET
    try:
        _ip("netns", "add", ns_r)
        _ip("netns", "add", ns_s)
        _ip("link", "add", dev_r, "type", "veth", "peer", "name", dev_s)
        _ip("link", "set", dev_r, "netns", ns_r)
        _ip("link", "set", dev_s, "netns", ns_s)
        for ns, dev, addr in ((ns_r, dev_r, addr_r), (ns_s, dev_s, addr_s)):
            _ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield NetPlan(
            "netns",
            addr_r,
            receiver_prefix=["ip", "netns", "exec", ns_r],
            sender_prefix=["ip", "netns", "exec", ns_s],
            receiver_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_r},
            sender_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_s},
            description=(
                f"two network namespaces joined by a veth pair ({addr_r}/{prefix} <-> "
                f"{addr_s}/{prefix}, MTU 1500); UCX_TLS=tcp"
            ),
        )
    finally:
        # deleting a namespace removes the veth end inside it (and so its peer)
        for ns in (ns_r, ns_s):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", dev_r)  # only there if setup failed before moving it


def netns_supported() -> str | None:
    """None when `ip netns` works here, else why not."""
    probe = f"pdbprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"ip netns unavailable: {getattr(e, 'stderr', '') or e}"
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return None


# ---- ucx_perftest -------------------------------------------------------------------------------
def libucx_dir() -> Path:
    import libucx

    return Path(libucx.__file__).resolve().parent


_FINAL = re.compile(r"Final:\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def perftest(plan: NetPlan, message_bytes: int, iters: int, timeout: float) -> dict[str, float]:
    """`ucx_perftest -t tag_bw -e` (endpoint error handling, like pdserve's endpoints) between
    a server on the receiver side and a client on the sender side. Returns the overall
    bandwidth in GB/s and the per-message time it implies."""
    ucx = libucx_dir()
    binary = str(ucx / "bin" / "ucx_perftest")
    base_env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(ucx / "lib"),
        "UCX_MM_ERROR_HANDLING": "y",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    warmup = max(1, iters // 10)
    for attempt in range(3):
        port = random.randint(20000, 40000)
        args = [binary, "-t", "tag_bw", "-e", "-s", str(message_bytes), "-n", str(iters)]
        args += ["-w", str(warmup), "-p", str(port)]
        server = subprocess.Popen(
            [*plan.receiver_prefix, *args],
            env={**base_env, **plan.receiver_env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            time.sleep(0.3 + 0.3 * attempt)  # let the server listen
            client = subprocess.run(
                [*plan.sender_prefix, *args, plan.receiver_host],
                env={**base_env, **plan.sender_env},
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            kill_group(server, grace=2)
        match = _FINAL.search(client.stdout)
        if match:
            mb_per_s = float(match.group(5))  # overall bandwidth, MB/s (2**20 bytes)
            gbps = mb_per_s * 2**20 / 1e9
            return {"gbps": gbps, "message_seconds": message_bytes / (gbps * 1e9)}
    raise RuntimeError(f"ucx_perftest failed: {client.stdout[-500:]} {client.stderr[-500:]}")
