"""UCX environment for the transfer plane; importing this module does not import ucxx.

UCX reads most of its configuration from `UCX_*` variables when a UCX context is created (the
first KvReceiver.start() / KvSender.send() of the process), and a few global ones when the library
is loaded (`import ucxx`). `transfer.worker` calls `configure_ucx_env()` with the defaults before
it imports ucxx, so importing `transfer.ucx` always gives a working setup; call it yourself, with
arguments, before that import (or at the latest before the first receiver/sender starts) to
change the defaults.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Defaults; an operator's environment wins over them (setdefault), explicit arguments win over
# both.
_DEFAULTS: dict[str, str] = {
    # ucxx turns endpoint error handling on (we need it: a dead peer must fail sends instead of
    # hanging them), and UCX then drops its shared-memory transports unless told that they may
    # be used with error handling; without this, same-host transfers run over tcp/lo at
    # ~0.4 GB/s instead of sysv shared memory at 5-10 GB/s (see transfer/worker.py).
    "UCX_MM_ERROR_HANDLING": "y",
    # A KV listener that restarts (transfer.listener) listens again on its port at once, while
    # the connections it accepted before may linger in TIME_WAIT (SO_REUSEADDR; on Linux it
    # never lets a second listener onto a port someone listens on).
    "UCX_TCP_CM_REUSEADDR": "y",
    # Without CUDA, UCX warns about UCX_MEMTYPE_CACHE (which ucxx sets) being unused.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # ucxx sets this itself on import; set here too so a context created before that import
    # (none today) would see the same value. Required by UCX for CUDA memory detection.
    "UCX_MEMTYPE_CACHE": "n",
}


# UCX reads its environment when a context is created (importing ucxx reads none of it): a
# variable set after the first context is what deserves a warning
_contexts_created = False


def context_created() -> None:
    """Called by whoever creates a UCX context (transfer/worker.py)."""
    global _contexts_created
    _contexts_created = True


def configure_ucx_env(
    *,
    tls: str | None = None,
    shm_error_handling: bool | None = None,
    bind_host: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> None:
    """Set the UCX environment of this process; idempotent.

    tls: value for UCX_TLS, None leaves transport selection to UCX (shared memory on one host,
        tcp across hosts or network namespaces, cuda_copy/cuda_ipc for GPU memory). Listener
        based connection setup needs tcp, so a list must keep it (e.g. "tcp,sm,cuda_copy").
    shm_error_handling: force UCX_MM_ERROR_HANDLING on/off (default on).
    bind_host: the address the KV listener binds (decode nodes). Besides that listener, UCX's
        tcp transport listens on every network device for its own connections; unless the
        operator set UCX_NET_DEVICES, it is limited to the device that owns this address, so
        no UCX socket of the node is reachable through another interface. An unspecified
        address (0.0.0.0, ::) or one no local device owns leaves UCX's choice alone.
    extra: further UCX_* variables, set as given.
    """
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    explicit: dict[str, str] = dict(extra or {})
    if bind_host is not None and "UCX_NET_DEVICES" not in os.environ:
        device = net_device_of(bind_host)
        if device is not None:
            explicit["UCX_NET_DEVICES"] = device
    if tls is not None:
        _check_tls(tls)
        explicit["UCX_TLS"] = tls
    if shm_error_handling is not None:
        explicit["UCX_MM_ERROR_HANDLING"] = "y" if shm_error_handling else "n"
    for key, value in explicit.items():
        if not key.startswith("UCX_"):
            raise ValueError(f"{key} is not a UCX_* variable")
        if _contexts_created and os.environ.get(key) != value:
            log.warning(
                "%s=%s set after ucxx was imported; it applies to UCX contexts created "
                "from now on only",
                key,
                value,
            )
        os.environ[key] = value


def _check_tls(tls: str) -> None:
    names = {name.strip().lstrip("^") for name in tls.split(",")}
    if tls.startswith("^") or "all" in names:
        return
    if "tcp" not in names:
        raise ValueError(f"UCX_TLS={tls!r} lacks tcp, which listener connection setup needs")


def net_device_of(host: str) -> str | None:
    """The name of the local network device that owns IP address `host` (Linux), or None for
    an unspecified address, a name, or an address no device owns."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    if ip.version == 6:
        return _ipv6_device(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this device
                continue
            if reply[20:24] == ip.packed:
                return name
    return None


_SIOCGIFADDR = 0x8915


def _ipv6_device(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and bytes.fromhex(fields[0]) == ip.packed:
                    return fields[5]
    except OSError:
        pass
    return None
