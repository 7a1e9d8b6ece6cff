"""An in-process cluster on its own event-loop thread, so hypothesis (synchronous) can drive it,
and the property every fuzzer checks after each example: the node still serves, conserved; and
the strings fuzzers send that are valid JSON but not Unicode text (lone surrogates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st

from pdserve.client import generate
from tests.engine_helpers import hf_greedy
from tests.support.cluster import PdCluster, pd_cluster
from tests.support.shared_cluster import LoopThread

PROBE = [5, 6, 7]  # the greedy request that must come out the same after every example


class LiveCluster:
    """1 prefill + 1 decode node (tiny checkpoint) for a whole fuzz module."""

    def __init__(self, path: Path, **decode_overrides: Any) -> None:
        self.runner = LoopThread()
        self.scope = pd_cluster(path, decode_overrides=decode_overrides or None)
        self.cluster: PdCluster = self.runner.run(self.scope.__aenter__())
        self.want = hf_greedy(path, PROBE, 4)

    async def still_serving(self) -> None:
        await self.cluster.assert_idle_and_conserved()
        ok = await generate(self.cluster.targets[0], PROBE, max_tokens=4, timeout=30)
        assert ok.token_ids == self.want, "greedy output changed after a fuzzed request"
        await self.cluster.assert_idle_and_conserved()

    def close(self) -> None:
        self.runner.run(self.scope.__aexit__(None, None, None))
        self.runner.close()


class LiveHttp(LiveCluster):
    """LiveCluster with the decode node's HTTP API and a synchronous client for it."""

    def __init__(self, path: Path, **decode_overrides: Any) -> None:
        super().__init__(path, http_port=0, **decode_overrides)
        node = self.cluster.decodes[0]
        self.url = f"http://127.0.0.1:{node.http_port}"
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def post(self, path: str, body: Any) -> httpx.Response:
        """`body` as JSON with every non-ASCII character escaped, so a lone surrogate goes out
        as `\\ud800` (httpx's json= encodes UTF-8 and cannot)."""
        data = json.dumps(body).encode()
        return self.client.post(path, content=data, headers={"content-type": "application/json"})

    def close(self) -> None:
        self.client.close()
        super().close()


# A lone surrogate (U+D800..U+DFFF): JSON can spell it, UTF-8 cannot encode it
lone_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


@st.composite
def text_with_a_lone_surrogate(draw: st.DrawFn) -> str:
    """Arbitrary text with one lone surrogate somewhere in it (never completing a pair)."""
    before, after = draw(st.text(max_size=20)), draw(st.text(max_size=20))
    return before + draw(lone_surrogates) + after
