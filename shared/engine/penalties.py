"""Per-seat penalty state: logit_bias, min_tokens, repetition / presence / frequency penalties.

Rows are indexed by seat (seat-system.md §6), like every sampler pool. A request's row is built
when it is first sampled in its seat, from its prompt and the tokens it already produced (the
prefill node's first token, or those before a preemption), updated with each sampled token, and
cleared before the seat goes back. Applying them is one batched pass over the rows that use them:
no Python loop over requests or the vocabulary per step.

The [seats, vocab] tensors are allocated on the first request that needs them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.engine.request import LlmRequest


class PenaltyState:
    def __init__(self, max_num_sequences: int, vocab_size: int, device: torch.device):
        seats, v = max_num_sequences, vocab_size
        self.vocab_size = vocab_size
        self.active = torch.zeros(seats, dtype=torch.bool, device=device)
        self.repetition = torch.ones(seats, dtype=torch.float32, device=device)
        self.presence = torch.zeros(seats, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(seats, dtype=torch.float32, device=device)
        self.min_tokens = torch.zeros(seats, dtype=torch.long, device=device)
        self.output_counts = torch.zeros((seats, v), dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros((seats, v), dtype=torch.bool, device=device)
        self.bias = torch.zeros((seats, v), dtype=torch.float32, device=device)
        # EOS and stop_token_ids: masked to -inf while fewer than min_tokens were produced
        self.stop_mask = torch.zeros((seats, v), dtype=torch.bool, device=device)

    @property
    def rows(self) -> int:
        return self.active.shape[0]

    def setup(self, seat: int, request: LlmRequest, eos_token_ids: Iterable[int]) -> None:
        p = request.sampling_params
        dev = self.active.device
        self.clear(seat)
        self.active[seat] = True
        self.repetition[seat] = p.repetition_penalty
        self.presence[seat] = p.presence_penalty
        self.frequency[seat] = p.frequency_penalty
        self.min_tokens[seat] = p.min_tokens
        if request.output_token_ids:
            out = torch.tensor(request.output_token_ids, dtype=torch.long, device=dev)
            self.output_counts[seat].index_add_(0, out, torch.ones(out.shape, device=dev))
        if p.repetition_penalty != 1.0:
            self.prompt_mask[seat, torch.tensor(request.prompt_token_ids, device=dev)] = True
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            self.bias[seat, ids] = torch.tensor(list(p.logit_bias.values()), device=dev)
        if p.min_tokens:
            stops = sorted({*eos_token_ids, *p.stop_token_ids})
            self.stop_mask[seat, torch.tensor(stops, dtype=torch.long, device=dev)] = True

    def clear(self, seat: int) -> None:
        self.active[seat] = False
        self.repetition[seat] = 1.0
        self.presence[seat] = 0.0
        self.frequency[seat] = 0.0
        self.min_tokens[seat] = 0
        self.output_counts[seat] = 0.0
        self.prompt_mask[seat] = False
        self.bias[seat] = 0.0
        self.stop_mask[seat] = False

    def apply(self, logits: torch.Tensor, seats: torch.Tensor, num_output: torch.Tensor) -> None:
        """In place on logits [rows, vocab] of these seats [rows], whose requests have produced
        num_output [rows] tokens. Order as vLLM: bias, min_tokens, then the penalties."""
        logits += self.bias[seats]
        early = (num_output < self.min_tokens[seats])[:, None]  # [rows, 1]
        logits.masked_fill_(self.stop_mask[seats] & early, float("-inf"))
        counts = self.output_counts[seats]  # [rows, vocab]
        produced = counts > 0
        rep = self.repetition[seats][:, None]
        seen = self.prompt_mask[seats] | produced
        penalized = torch.where(logits < 0, logits * rep, logits / rep)
        logits.copy_(torch.where(seen, penalized, logits))
        logits -= counts * self.frequency[seats][:, None]
        logits -= produced * self.presence[seats][:, None]

    def record(self, seats: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each seat's newly sampled token (seats [rows], tokens [rows])."""
        self.output_counts.index_put_(
            (seats, tokens), torch.ones(seats.shape, device=seats.device), accumulate=True
        )
