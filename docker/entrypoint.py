"""Container entry point: `<image> prefill|decode|colocated|encode|proxy [pdserve options]`,
anything else is run as given (e.g. `<image> pdserve generate "Hello" --target proxy:50051`,
`<image> bash`).

Fills in what a container needs and the CLI defaults do not give, unless the command line (or
the environment) already says otherwise:
  --host 0.0.0.0          gRPC and /metrics listen on every interface ($PDSERVE_HOST)
  --metrics-port 9100     /metrics on a fixed port for scraping ($PDSERVE_METRICS_PORT)
  --ucx-host <address>    decode, and prefill with --encoder: the UCX listener (KV, or the
                          encoders' embeddings) must bind an address its peers can reach, so
                          the container's own address on the network that leads to them (the
                          --prefill, or --encoder, service) ($PDSERVE_UCX_HOST)
Then it exec()s the node, so the node is PID 1 and receives SIGTERM from `docker stop`.
"""

from __future__ import annotations

import os
import socket
import sys

# Every server the `pdserve` command starts (a colocated node prefills its own prompts: no
# prefill service, no KV listener to place); `up` is a whole cluster on loopback, not a role.
ROLES = ("prefill", "decode", "colocated", "encode", "proxy")


def has_option(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def option_value(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def own_address_towards(targets: str | None) -> str:
    """The local address this container uses to reach the first resolvable target (the source
    address the kernel picks for it), else the address its hostname resolves to."""
    for target in (targets or "").split(","):
        host, _, port = target.strip().rpartition(":")
        if not host or not port.isdigit():
            continue
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, _, _, _, sockaddr in infos:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                try:
                    s.connect(sockaddr)  # UDP: picks a route and source address, sends nothing
                except OSError:
                    continue
                return str(s.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


def node_command(role: str, args: list[str]) -> list[str]:
    extra: list[str] = []
    if not has_option(args, "--host"):
        extra += ["--host", os.environ.get("PDSERVE_HOST", "0.0.0.0")]
    if not has_option(args, "--metrics-port"):
        extra += ["--metrics-port", os.environ.get("PDSERVE_METRICS_PORT", "9100")]
    peers = {"decode": "--prefill", "prefill": "--encoder"}.get(role)
    listens = peers is not None and (role == "decode" or has_option(args, "--encoder"))
    if listens and not has_option(args, "--ucx-host"):
        ucx_host = os.environ.get("PDSERVE_UCX_HOST") or own_address_towards(
            option_value(args, peers)
        )
        extra += ["--ucx-host", ucx_host]
    if role == "proxy":
        return [sys.executable, "-m", "pdserve.proxy", *args, *extra]
    return ["pdserve", role, *args, *extra]


def main(argv: list[str]) -> None:
    if not argv:
        argv = ["pdserve", "--help"]
    cmd = node_command(argv[0], argv[1:]) if argv[0] in ROLES else argv
    print("entrypoint: exec " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
