"""The OpenAI-compatible HTTP API (FastAPI + pydantic, served by uvicorn on the node's loop)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared.serving.http.app import create_app
from shared.serving.http.service import Backend, HttpApiConfig
from shared.serving.metrics import AsgiServer
from shared.serving.tls import ServerTls

__all__ = ["HttpApiConfig", "create_app", "serve_http_api"]


async def serve_http_api(
    backend: Backend,
    config: HttpApiConfig,
    registry: CollectorRegistry,
    host: str,
    port: int,
    tls: ServerTls | None,
) -> AsgiServer:
    """The API (plus /metrics, /health, /version) on (host, port), TLS with the gRPC options."""
    app = create_app(backend, config, registry)
    if tls is None:
        return await AsgiServer.start(app, host, port, limits=config.connection)
    return await AsgiServer.start(
        app,
        host,
        port,
        certfile=tls.cert,
        keyfile=tls.key,
        client_ca=tls.client_ca or None,
        limits=config.connection,
    )
