"""How a prefill node pushes a prompt's KV here: layer by layer while the prompt computes, or the
whole request after its last layer (`--push layerwise|whole|auto`).

Why `auto` does not always push layer-wise: on a CPU prefill node the KV sender shares the cores
that compute the prompt. Each layer message costs the prefill node's event loop 1-1.5 ms of CPU
(block spans, header, two UCX sends, wake-ups, all on caches the prompt's compute keeps cold),
taken from the prompt's compute while it runs; a 4k-token prompt's prefill took 2-6% longer
pushed layer-wise than pushed whole on the same prefill node (docs/performance.md, "Layer-wise
or whole-request push"). What layer-wise buys is the transfer time after the last layer, and
over same-host shared memory that is ~0.5 ms for either push. So `auto` pushes whole when the
prefill node is on this host (its address is one of this host's) and the KV pool is in host
memory; across hosts (TCP, RDMA: a transfer that takes milliseconds to seconds) and from GPU
pools (compute that does not share a core with the sender) it pushes layer-wise.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

from transfer.protocol import split_address

PUSH_MODES = ("auto", "layerwise", "whole")


@functools.cache
def is_local_address(host: str) -> bool:
    """Whether `host` (an IP address, as a resolved gRPC target is) is this host's own: loopback,
    or an address of one of this network namespace's interfaces (binding to it succeeds)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: not resolved here, so not known to be local
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def pushes_layerwise(mode: str, prefill_target: str, kv_on_cpu: bool) -> bool:
    """Whether to ask the prefill node at `prefill_target` (a resolved HOST:PORT) for a
    layer-wise push (the module docstring says why `auto` decides as it does)."""
    if mode == "layerwise":
        return True
    if mode == "whole":
        return False
    if mode != "auto":
        raise ValueError(f"push mode must be one of {', '.join(PUSH_MODES)}, got {mode!r}")
    return not (kv_on_cpu and is_local_address(split_address(prefill_target)[0]))
