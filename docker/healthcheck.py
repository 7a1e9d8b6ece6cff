"""Docker HEALTHCHECK: ask this container's pdserve server over the gRPC health protocol
(grpc.health.v1.Health/Check, service "") and exit 0 only when it answers SERVING.

The port is read from the node's own command line (PID 1, or the first pdserve process found
under /proc when an init runs as PID 1): `--port N`, else the role's default (prefill 50061,
decode, colocated and proxy 50051). $PDSERVE_HEALTH_TARGET (HOST:PORT) overrides it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_PORTS = {
    "prefill": 50061,
    "decode": 50051,
    "colocated": 50051,
    "encode": 50071,
    "pdserve.proxy": 50051,
    "proxy": 50051,
}


def node_port(argv: list[str]) -> int | None:
    role = next((a for a in argv[:3] if a in DEFAULT_PORTS), None)  # [script|-m mod] role
    if role is None:
        return None
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return DEFAULT_PORTS[role]


def find_target() -> str:
    if os.environ.get("PDSERVE_HEALTH_TARGET"):
        return os.environ["PDSERVE_HEALTH_TARGET"]
    pids = sorted(
        (p for p in Path("/proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    for pid in pids:
        try:
            argv = (pid / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        port = node_port(argv[1:])
        if port is not None:
            return f"127.0.0.1:{port}"
    raise SystemExit("healthcheck: no pdserve node process found")


def main() -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = find_target()
    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3.0
            )
        except grpc.RpcError as e:
            print(f"healthcheck: {target}: {e.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"healthcheck: {target}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
