"""`--push`: which KV push a decode node asks of each prefill node (decode_node/push_mode.py)."""

from __future__ import annotations

import socket

import pytest

from decode_node.config import DecodeNodeConfig
from decode_node.push_mode import is_local_address, pushes_layerwise
from pdserve.cli.node_command import push_mode
from pdserve.cli.parser import build_parser


def _an_address_of_this_host() -> str | None:
    """A non-loopback IPv4 address of this host's interfaces, if any (the route to a TEST-NET
    address picks one without sending anything)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        host = s.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


def test_local_addresses() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("127.0.0.2")
    assert is_local_address("::1")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never an interface's address
    assert not is_local_address("prefill-0")  # a name: not known to be local
    mine = _an_address_of_this_host()
    if mine is not None:
        assert is_local_address(mine)


def test_auto_pushes_whole_only_from_this_host_into_a_cpu_pool() -> None:
    assert not pushes_layerwise("auto", "127.0.0.1:5000", kv_on_cpu=True)
    assert pushes_layerwise("auto", "127.0.0.1:5000", kv_on_cpu=False)  # GPU pools: layer-wise
    assert pushes_layerwise("auto", "192.0.2.1:5000", kv_on_cpu=True)  # another host
    assert pushes_layerwise("auto", "[2001:db8::1]:5000", kv_on_cpu=True)
    assert not pushes_layerwise("auto", "[::1]:7000", kv_on_cpu=True)  # bracketed v6 loopback
    assert pushes_layerwise("auto", "prefill-0:50052", kv_on_cpu=True)  # a name: not known local
    for target in ("127.0.0.1:5000", "192.0.2.1:5000"):
        for on_cpu in (True, False):
            assert pushes_layerwise("layerwise", target, on_cpu)
            assert not pushes_layerwise("whole", target, on_cpu)
    with pytest.raises(ValueError, match="auto, layerwise, whole"):
        pushes_layerwise("eager", "127.0.0.1:5000", True)


def test_config_and_flags() -> None:
    with pytest.raises(ValueError, match="--push must be one of"):
        DecodeNodeConfig(prefill_targets=("h:1",), push="fast").validate()
    DecodeNodeConfig(prefill_targets=("h:1",), push="whole").validate()
    parse = build_parser().parse_args
    base = ["decode", "--model", "tiny", "--prefill", "h:1"]
    assert push_mode(parse(base)) == "auto"
    assert push_mode(parse([*base, "--push", "layerwise"])) == "layerwise"
    assert push_mode(parse([*base, "--whole-request-push"])) == "whole"  # the older flag
    assert push_mode(parse([*base, "--whole-request-push", "--push", "whole"])) == "whole"
    with pytest.raises(SystemExit, match="contradicts"):
        push_mode(parse([*base, "--whole-request-push", "--push", "layerwise"]))
    with pytest.raises(SystemExit):
        parse([*base, "--push", "eager"])
