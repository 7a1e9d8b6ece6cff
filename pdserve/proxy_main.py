"""The proxy's process (pdserve/proxy.py): flags parsed, the proxy served until SIGTERM, and the
line `pdserve up` waits for."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from pdserve.cli.proxy_args import add_arguments
from pdserve.proxy import Proxy
from shared.serving import tracing

log = logging.getLogger("pdserve.proxy")


def run(a: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(
        level=getattr(logging, a.log_level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    backends = [t.strip() for t in a.backend.split(",") if t.strip()]
    for t in backends:
        host, sep, port = t.rpartition(":")
        if not sep or not host or not port.isdigit():
            print(f"pdserve proxy: invalid backend {t!r} (want HOST:PORT)", file=sys.stderr)
            return 2

    async def main() -> int:
        proxy = Proxy(
            backends,
            health_interval=a.health_interval,
            max_attempts=a.max_attempts,
            routing=a.routing,
            max_resumes=a.max_resumes,
        )
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        http = [t.strip() for t in a.backend_http.split(",") if t.strip()]
        await proxy.start(a.host, a.port, a.metrics_port, a.http_port, a.backend_http_port, http)
        info = {
            "role": "proxy",
            "port": proxy.port,
            "metrics_port": proxy.metrics_server.port if proxy.metrics_server else None,
            "http_port": proxy.http_server.port if proxy.http_server else None,
        }
        print("PDSERVE_READY " + json.dumps(info), flush=True)
        await stopping.wait()
        log.info("shutting down")
        await proxy.stop(a.grace)
        return 0

    tracing.setup("pdserve-proxy", a.otlp_traces_endpoint)
    try:
        return uvloop.run(main())
    finally:
        tracing.shutdown()  # exports the spans still buffered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve proxy",
        description="pdserve proxy: the public gRPC endpoint in front of the decode tier.",
    )
    add_arguments(p)
    return run(p.parse_args(argv))
