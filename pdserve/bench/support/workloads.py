"""The shared-prefix workload of `pdserve bench serve --workload shared-prefix`: the traffic a
prefix cache (and KV-aware routing) is for. Pure: token ids from a seeded generator, no I/O.

- **System-prompt users**: `num_system_prompts` long system prompts (`system_prompt_len`
  tokens), each shared by many users; a user's request is its system prompt + a user message of
  `user_len` tokens of its own.
- **Conversations** that grow: turn 1 = a system prompt + a user message; turn k = turn k-1's
  prompt + an answer of `answer_len` tokens (what the model would have said) + a new user
  message. Each turn's prefix is the whole previous turn.

Order (what the arrival model then spaces out): `turns` rounds; round t holds turn t of every
conversation, always in the same conversation order, and an equal share of the single-turn users
at random places, so that two turns of one conversation are about a round apart (the earlier has
usually finished, and its KV is cached, when the later arrives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SharedPrefixConfig:
    num_requests: int  # in all: single-turn users + num_conversations * turns
    num_system_prompts: int = 4
    system_prompt_len: int = 1024
    user_len: int = 64
    num_conversations: int = 8
    turns: int = 4
    answer_len: int = 64

    def __post_init__(self) -> None:
        for name in ("num_system_prompts", "system_prompt_len", "user_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_conversations < 0 or self.answer_len < 0:
            raise ValueError("num_conversations and answer_len must be >= 0")
        if self.num_users < 0:
            raise ValueError(
                f"num_requests ({self.num_requests}) is less than num_conversations * turns "
                f"({self.num_conversations} * {self.turns})"
            )

    @property
    def num_users(self) -> int:
        """Single-turn requests: what the conversations leave of num_requests."""
        return self.num_requests - self.num_conversations * self.turns

    def max_prompt_len(self) -> int:
        grow = (self.turns - 1) * (self.answer_len + self.user_len)
        return self.system_prompt_len + self.user_len + (grow if self.num_conversations else 0)


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int]
    kind: str  # "user" (one turn on a shared system prompt) or "conversation"
    system_prompt: int  # which system prompt it starts with
    conversation: int = -1  # conversation id (kind "conversation")
    turn: int = 0  # 1-based turn (kind "conversation")


def shared_prefix_requests(
    config: SharedPrefixConfig, vocab: int, seed: int
) -> list[WorkloadRequest]:
    """The requests in arrival order; the same config, vocab and seed give the same list."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, size=n)]

    systems = [tokens(config.system_prompt_len) for _ in range(config.num_system_prompts)]
    conversations = _conversations(config, systems, tokens)
    users = [
        WorkloadRequest(systems[s] + tokens(config.user_len), "user", int(s))
        for s in rng.integers(0, config.num_system_prompts, size=config.num_users)
    ]
    # the users, split as evenly as possible over the rounds, each round's at random places
    shares = np.array_split(np.arange(len(users)), config.turns)
    out: list[WorkloadRequest] = []
    for t, share in enumerate(shares):
        round_ = [conv[t] for conv in conversations]
        for i in sorted(share, reverse=True):
            round_.insert(int(rng.integers(0, len(round_) + 1)), users[i])
        out += round_
    return out


def _conversations(
    config: SharedPrefixConfig, systems: list[list[int]], tokens: Callable[[int], list[int]]
) -> list[list[WorkloadRequest]]:
    """Every conversation's turns, each turn's prompt extending the previous turn's."""
    out = []
    for c in range(config.num_conversations):
        s = c % len(systems)
        prompt = systems[s] + tokens(config.user_len)
        turns = [WorkloadRequest(prompt, "conversation", s, c, 1)]
        for k in range(2, config.turns + 1):
            prompt = prompt + tokens(config.answer_len) + tokens(config.user_len)
            turns.append(WorkloadRequest(prompt, "conversation", s, c, k))
        out.append(turns)
    return out
