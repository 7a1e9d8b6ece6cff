"""Process entry points for one node of each role (used by the CLI and by `pdserve up`)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import uvloop

from decode_node.config import DecodeNodeConfig
from prefill_node.config import PrefillNodeConfig
from transfer.ucx import configure_ucx_env

log = logging.getLogger("pdserve")


def announce(role: str, **fields: object) -> None:
    """One machine-readable line on stdout: `pdserve up` and tests wait for it."""
    print("PDSERVE_READY " + json.dumps({"role": role, **fields}), flush=True)


async def _serve_until_signal(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[bool | None]]
) -> int:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await start()
    await stopping.wait()
    log.info("shutting down")
    conserved = await stop()
    return 0 if conserved in (True, None) else 3


def run_prefill(config: PrefillNodeConfig) -> int:
    configure_ucx_env()
    from prefill_node.server import PrefillNode

    async def main() -> int:
        node = PrefillNode(config)

        async def start() -> None:
            await node.start()
            announce(
                "prefill",
                port=node.port,
                metrics_port=node.serving.metrics_port if node.serving else None,
            )

        return await _serve_until_signal(start, node.stop)

    return uvloop.run(main())


def run_decode(config: DecodeNodeConfig) -> int:
    configure_ucx_env(bind_host=config.kv_bind_host)
    from decode_node.server import DecodeNode

    async def main() -> int:
        node = DecodeNode(config)

        async def start() -> None:
            await node.start()
            announce(
                "decode",
                port=node.port,
                ucx_address=node.receiver.address,
                metrics_port=node.serving.metrics_port if node.serving else None,
                http_port=node.http_port,
                http_scheme=node.http.scheme if node.http else None,
            )

        return await _serve_until_signal(start, node.stop)

    return uvloop.run(main())


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
