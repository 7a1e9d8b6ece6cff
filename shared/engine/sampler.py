"""Batched sampling with per-seat state (seat-system.md §6).

Randomness is a pure function of (request seed, output index): each sampled token draws one
uniform from a splitmix64 counter stream, then inverts the CDF of the filtered distribution.
So a seeded request gives the same text whatever else is in the batch, and a prefill node (which
samples output 0) and a decode node (outputs 1..) draw from one per-request stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.engine.request import LlmRequest

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_uniform(seed: int, index: int) -> float:
    """The `index`-th uniform in [0, 1) of the stream named by `seed`."""
    return (splitmix64(splitmix64(seed) ^ index) >> 11) / float(1 << 53)


class Sampler:
    def __init__(self, max_num_sequences: int, device: torch.device | str = "cpu"):
        self.max_num_sequences = max_num_sequences
        self.dummy_slot_row = max_num_sequences  # scratch for padding rows, owned by nobody
        self.device = torch.device(device)
        # (tokens per step, seats + scratch row, beam)
        self.new_tokens = torch.zeros(
            (1, max_num_sequences + 1, 1), dtype=torch.long, device=self.device
        )
        self.temperature = torch.zeros(max_num_sequences, dtype=torch.float32)
        self.top_p = torch.ones(max_num_sequences, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_sequences, dtype=torch.long)
        self.seeds: list[int | None] = [None] * max_num_sequences
        self.owner: list[str | None] = [None] * max_num_sequences
        self._check_invariants()

    def _check_invariants(self) -> None:
        assert self.new_tokens.shape[1] == self.max_num_sequences + 1
        for name in ("temperature", "top_p", "top_k"):
            rows = getattr(self, name).shape[0]
            assert rows == self.max_num_sequences, f"{name} has {rows} rows"
        assert len(self.seeds) == len(self.owner) == self.max_num_sequences

    def _seat(self, request: LlmRequest) -> int:
        seat = request.seq_slot
        if seat is None:
            raise RuntimeError(f"request {request.request_id} sampled without a seat")
        owner = self.owner[seat]
        if owner is None:
            self._setup(request, seat)
        elif owner != request.request_id:
            raise RuntimeError(f"seat {seat} holds stale state of {owner}")
        return seat

    def _setup(self, request: LlmRequest, seat: int) -> None:
        params = request.sampling_params
        self.temperature[seat] = params.temperature
        self.top_p[seat] = params.top_p
        self.top_k[seat] = params.top_k
        self.seeds[seat] = params.seed
        self.owner[seat] = request.request_id

    def release_request(self, request: LlmRequest) -> None:
        """Clear the request's per-seat state; runs before the seat goes back to the pool."""
        seat = request.seq_slot
        if seat is None or self.owner[seat] != request.request_id:
            return
        self.temperature[seat] = 0.0
        self.top_p[seat] = 1.0
        self.top_k[seat] = 0
        self.seeds[seat] = None
        self.owner[seat] = None
        self.new_tokens[:, seat] = 0

    def seats_in_use(self) -> int:
        return sum(o is not None for o in self.owner)

    def sample(self, requests: Sequence[LlmRequest | None], logits: torch.Tensor) -> list[int]:
        """One call per step. `None` rows are padding: sampled into the scratch row, discarded."""
        rows = [self.dummy_slot_row if r is None else self._seat(r) for r in requests]
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        live = [i for i, r in enumerate(requests) if r is not None]
        seats = torch.tensor([rows[i] for i in live], dtype=torch.long)
        if live:
            temps = self.temperature[seats]
            random_rows = (temps > 0).nonzero().flatten()
            if random_rows.numel():
                idx = torch.tensor(live, dtype=torch.long)[random_rows]
                uniforms = [
                    stream_uniform(self.seeds[rows[i]] or 0, len(requests[i].output_token_ids))  # type: ignore[union-attr]
                    for i in idx.tolist()
                ]
                tokens[idx] = self._sample_random(
                    logits[idx.to(logits.device)].cpu(),
                    temps[random_rows],
                    self.top_k[seats[random_rows]],
                    self.top_p[seats[random_rows]],
                    torch.tensor(uniforms, dtype=torch.float64),
                ).to(tokens.device)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.new_tokens.device)
        self.new_tokens[0, row_index, 0] = tokens.to(self.new_tokens.device)
        return tokens.tolist()

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        temps: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        scaled = logits / temps[:, None]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab)[None, :]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits.double(), dim=-1)
        # keep the smallest prefix whose mass reaches top_p; the top token always survives
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.double()[:, None], 0.0)
        cdf = probs.cumsum(dim=-1)
        targets = uniforms * cdf[:, -1]
        choice = torch.searchsorted(cdf, targets[:, None], right=True).clamp(max=vocab - 1)
        return sorted_ids.gather(1, choice).flatten()
