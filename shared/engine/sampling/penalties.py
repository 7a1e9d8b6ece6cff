"""Per-seat penalty state: logit_bias, min_tokens, repetition / presence / frequency penalties.

Rows are indexed by seat (docs/seat-system.md §6), like every sampler pool. A request's row is built
when it is first sampled in its seat, from its prompt and the tokens it already produced (the
prefill node's first token, or those before a preemption), updated with each sampled token, and
cleared before the seat goes back. Applying them is one batched pass over the rows that use them:
no Python loop over requests or the vocabulary per step.

What each step reads is kept ready: OpenAI's additive penalty `count * frequency + (count > 0) *
presence` as one dense row per seat (updated by one element per sampled token), transformers'
"seen" set (prompt + output) as a bool row, logit_bias and the min_tokens stop ids as short
padded id lists. The [seats, vocab] tensors are allocated on the first request that needs them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

MAX_EOS_IDS = 8  # EOS ids a model may declare (the stop-id list reserves room for them)


class PenaltyState:
    def __init__(self, max_num_sequences: int, vocab_size: int, device: torch.device):
        seats, v = max_num_sequences, vocab_size
        f32 = {"dtype": torch.float32, "device": device}
        self.vocab_size = vocab_size
        self.active = torch.zeros(seats, dtype=torch.bool, device=device)
        self.repetition = torch.ones(seats, **f32)
        self.presence = torch.zeros(seats, **f32)
        self.frequency = torch.zeros(seats, **f32)
        self.min_tokens = torch.zeros(seats, dtype=torch.long, device=device)
        self.additive = torch.zeros((seats, v), **f32)  # subtracted from the logits
        self.produced = torch.zeros((seats, v), dtype=torch.bool, device=device)  # outputs
        self.seen = torch.zeros((seats, v), dtype=torch.bool, device=device)  # prompt + outputs
        # logit_bias as (id, value) pairs; padding adds 0.0 to token 0
        self.bias_ids = torch.zeros((seats, MAX_LOGIT_BIAS), dtype=torch.long, device=device)
        self.bias_values = torch.zeros((seats, MAX_LOGIT_BIAS), **f32)
        # EOS + stop_token_ids, masked to -inf while fewer than min_tokens were produced;
        # padding repeats the first id
        width = MAX_STOP_TOKEN_IDS + MAX_EOS_IDS
        self.stop_ids = torch.zeros((seats, width), dtype=torch.long, device=device)

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
            counts = torch.bincount(out, minlength=self.vocab_size).float()
            self.produced[seat] = counts > 0
            self.additive[seat] = counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
            self.seen[seat] = counts > 0
        self.seen[seat, torch.tensor(request.prompt_token_ids, device=dev)] = True
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            self.bias_ids[seat, : len(ids)] = ids
            self.bias_values[seat, : len(ids)] = torch.tensor(list(p.logit_bias.values()))
        stops = sorted({*eos_token_ids, *p.stop_token_ids})
        if p.min_tokens and stops:
            assert len(stops) <= self.stop_ids.shape[1], "more EOS + stop ids than reserved"
            self.stop_ids[seat] = stops[0]
            self.stop_ids[seat, : len(stops)] = torch.tensor(stops, dtype=torch.long)

    def clear(self, seat: int) -> None:
        self.active[seat] = False
        self.repetition[seat] = 1.0
        self.presence[seat] = 0.0
        self.frequency[seat] = 0.0
        self.min_tokens[seat] = 0
        self.additive[seat] = 0.0
        self.produced[seat] = False
        self.seen[seat] = False
        self.bias_ids[seat] = 0
        self.bias_values[seat] = 0.0
        self.stop_ids[seat] = 0

    def apply(self, logits: torch.Tensor, seats: torch.Tensor, num_output: torch.Tensor) -> None:
        """In place on logits [rows, vocab] of these seats [rows], whose requests have produced
        num_output [rows] tokens. Order as vLLM: bias, min_tokens, then the penalties. Each
        [rows, vocab] pass runs only when some row in the batch uses it."""
        logits.scatter_add_(1, self.bias_ids[seats], self.bias_values[seats])
        early = (num_output < self.min_tokens[seats]).nonzero().flatten()  # [early rows]
        if early.numel():
            ids = self.stop_ids[seats[early]]  # [early rows, width]
            logits[early] = logits[early].scatter(1, ids, float("-inf"))
        # the penalties touch only the tokens a row has seen: work on those (row, token) pairs
        rep = self.repetition[seats]  # [rows]
        if bool((rep != 1.0).any()):
            rows, cols = self.seen[seats].nonzero(as_tuple=True)  # [pairs]
            x, r = logits[rows, cols], rep[rows]
            # transformers: a seen token's logit is divided by rep when > 0, multiplied when < 0
            logits[rows, cols] = torch.where(x < 0, x * r, x / r)
        if bool((self.frequency[seats] != 0.0).any() or (self.presence[seats] != 0.0).any()):
            rows, cols = self.produced[seats].nonzero(as_tuple=True)
            logits[rows, cols] -= self.additive[seats[rows], cols]

    def record(self, seats: torch.Tensor, tokens: torch.Tensor) -> None:
        """Account each seat's newly sampled token (seats [rows] are distinct)."""
        first = ~self.produced[seats, tokens]
        self.additive[seats, tokens] += self.frequency[seats] + self.presence[seats] * first
        self.produced[seats, tokens] = True
        self.seen[seats, tokens] = True
