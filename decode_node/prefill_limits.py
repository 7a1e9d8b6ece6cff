"""The longest request the prefill nodes can take, as they report it.

A prefill node's pool may be smaller than this node's (another machine, another
`--kv-cache-mb`), and it refuses a prompt + max_tokens beyond its own `max_model_len` or a prompt
beyond its pool. The decode node learns both from the `GetModelInfo` it already asks each prefill
node (`max_context`, `num_kv_blocks`; decode_node/peers.py), takes the tightest over the nodes
that answered, advertises no more than that, and refuses at once, naming the prefill node's
limit, a request no prefill node would take: not after a queue wait and a failed dispatch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from decode_node.peers import PrefillPeer
from shared.cdiv import cdiv
from shared.engine.errors import RequestRejected
from shared.engine.info import EngineInfo


@dataclass(frozen=True)
class PrefillLimit:
    target: str  # the prefill node that sets it
    max_context: int  # its max_model_len: prompt + max_tokens
    pool_blocks: int  # its whole pool: the prompt's blocks
    block_size: int

    @property
    def prompt_tokens(self) -> int:
        return self.pool_blocks * self.block_size

    @property
    def context(self) -> int:
        """The longest prompt + max_tokens it takes: its max_model_len, and no more than its
        pool holds (a node that does not check its max_model_len against its pool): a whole
        pool of prompt and the first token, which it samples but never stores."""
        return min(self.max_context, self.prompt_tokens + 1)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise RequestRejected naming the prefill node's limit."""
        total = prompt_len + max_tokens
        if total > self.context:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + sampling.max_tokens ({max_tokens}) = {total} "
                f"exceeds the prefill nodes' context of {self.context} tokens (prefill node "
                f"{self.target}: {self.pool_blocks} KV blocks = {self.prompt_tokens} tokens); "
                "shorten the prompt or max_tokens, or give the prefill nodes a larger KV pool"
            )
        if cdiv(prompt_len, self.block_size) > self.pool_blocks:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) exceeds what prefill node {self.target}'s whole "
                f"KV pool holds ({self.pool_blocks} blocks = {self.prompt_tokens} tokens); "
                "shorten the prompt, or give the prefill nodes a larger KV pool"
            )


def tightest(peers: Iterable[PrefillPeer], fingerprint: str) -> PrefillLimit | None:
    """The smallest limit over the peers that reported theirs with this node's KV layout
    (`fingerprint`; another is never sent a request); None: none has yet."""
    limits = [
        PrefillLimit(p.target, p.max_context, p.num_kv_blocks, p.layout.block_size)
        for p in peers
        if p.layout is not None
        and p.layout.fingerprint == fingerprint
        and p.max_context
        and p.num_kv_blocks
    ]
    return min(limits, key=lambda limit: limit.context, default=None)


def served(info: EngineInfo, limit: PrefillLimit | None) -> EngineInfo:
    """This node's facts with the context it serves: its own, no more than the prefill
    nodes'."""
    if limit is None or limit.context >= info.max_model_len:
        return info
    return replace(info, max_model_len=limit.context)
