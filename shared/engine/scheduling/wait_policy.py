"""A node's OpenMP workers sleep as soon as they are idle: OMP_WAIT_POLICY=PASSIVE by default.

libgomp's default keeps an idle worker spinning for about 3 ms (300,000 spins) after every
parallel region. On a core the node shares (with its own event loop, gRPC and UCX threads, with
another node on the host, or after an operator narrowed its CPUs and before the engine resized
its team: shared/engine/runtime/cpu_threads.py) the spinning worker holds the core that the thread
it waits for needs. SmolLM2 fp32, two threads on one core of two, a 16-token prompt's first token:
1,458 ms spinning, 58 ms passive. The price on cores a node has to itself is a futex wake-up per
parallel region (1.6x slower batch-32 decode at 2 threads on a quiet machine,
docs/performance.md); an operator who dedicates cores sets OMP_WAIT_POLICY or GOMP_SPINCOUNT
(300000 is libgomp's own default), and either is kept.

libgomp reads them once, when it loads, which is when torch is imported: pdserve/cli/main.py sets
them before its first import of anything that imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

NODE_COMMANDS = frozenset({"prefill", "decode", "colocated"})
OPERATOR_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def node_defaults(args: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to the environment of a process started with `pdserve *args`: the passive
    wait policy for a node command, nothing for other commands or where the operator chose."""
    if not args or args[0] not in NODE_COMMANDS:
        return {}
    if any(name in environ for name in OPERATOR_VARIABLES):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
