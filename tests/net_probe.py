"""What a process listens on, read from /proc (Linux): for tests of bind addresses."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            found.add((_proc_ip(addr_hex, width), int(port_hex, 16)))
    return found


def _proc_ip(addr_hex: str, width: int) -> str:
    raw = bytes.fromhex(addr_hex)
    # /proc prints each 32-bit word in host byte order
    words = struct.unpack(f"<{width // 4}I", raw)
    ip = ipaddress.ip_address(struct.pack(f">{width // 4}I", *words))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)  # gRPC binds IPv4 as ::ffff:a.b.c.d
    return str(ip)


def tcp_connects(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a plain TCP connection to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
