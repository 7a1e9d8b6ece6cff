"""Process entry points for one node of each role (used by the CLI and by `pdserve up`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import uvloop

from decode_node.config import DecodeNodeConfig
from encode_node.config import EncodeNodeConfig
from pdserve import lifeline
from pdserve.restart_count import export_restarts
from prefill_node.config import PrefillNodeConfig
from shared.serving.limits import ORPHAN_DRAIN_GRACE_S
from transfer.ucx import configure_ucx_env

log = logging.getLogger("pdserve")


def announce(role: str, **fields: object) -> None:
    """One machine-readable line on stdout: `pdserve up` and tests wait for it."""
    try:
        print("PDSERVE_READY " + json.dumps({"role": role, **fields}), flush=True)
    except BrokenPipeError:
        # the parent died while we started (the lifeline drains us next); later writes to
        # stdout must not raise again
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


async def _serve_until_signal(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[float], Awaitable[bool | None]],
    grace: float,
) -> int:
    """Serve until SIGTERM/SIGINT or the parent's death (the lifeline closes), then drain."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    orphaned = False

    def parent_gone() -> None:
        nonlocal orphaned
        orphaned = True
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # watched from the start: a parent that dies while we load the model still takes us along
    lifeline.watch(loop, parent_gone)
    await start()
    await stopping.wait()
    log.info("shutting down")
    # nobody waits for an orphan's in-flight streams for long: its parent is gone
    conserved = await (stop(min(grace, ORPHAN_DRAIN_GRACE_S)) if orphaned else stop(grace))
    if conserved in (True, None):
        log.info("stopped: every seat and block back in its pool")
        code = 0
    else:
        log.error("stopped: seats or blocks NOT conserved")
        code = 3
    if orphaned:
        # drained, checked, every endpoint closed: skip the interpreter's teardown of torch and
        # UCX (1-2 s measured), so that the ports are free well within 2 s of the parent's death
        logging.shutdown()
        os._exit(code)
    return code


def run_prefill(config: PrefillNodeConfig) -> int:
    # with encoder nodes it listens for their pushes, as a decode node does for KV
    configure_ucx_env(bind_host=config.kv_bind_host if config.encoder_targets else None)
    from prefill_node.server import PrefillNode

    async def main() -> int:
        node = PrefillNode(config)
        export_restarts(node.metrics.registry)

        async def start() -> None:
            await node.start()
            announce(
                "prefill",
                port=node.port,
                metrics_port=node.serving.metrics_port if node.serving else None,
            )

        return await _serve_until_signal(start, node.stop, config.drain_grace)

    return uvloop.run(main())


def run_encoder(config: EncodeNodeConfig) -> int:
    from encode_node.server import EncodeNode

    async def main() -> int:
        node = EncodeNode(config)

        async def start() -> None:
            await node.start()
            announce(
                "encode",
                port=node.port,
                metrics_port=node.serving.metrics_port if node.serving else None,
            )

        return await _serve_until_signal(start, node.stop, config.drain_grace)

    return uvloop.run(main())


def run_decode(config: DecodeNodeConfig) -> int:
    configure_ucx_env(bind_host=config.kv_bind_host)
    from decode_node.server import DecodeNode

    async def main() -> int:
        node = DecodeNode(config)
        export_restarts(node.metrics.registry)

        async def start() -> None:
            await node.start()
            announce(
                "colocated" if config.colocated else "decode",
                port=node.port,
                ucx_address=node.receiver.address,
                metrics_port=node.serving.metrics_port if node.serving else None,
                http_port=node.http_port,
                http_scheme=node.http.scheme if node.http else None,
            )

        return await _serve_until_signal(start, node.stop, config.drain_grace)

    return uvloop.run(main())
