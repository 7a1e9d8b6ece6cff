"""Batched sampling with per-seat state (docs/seat-system.md §6).

Randomness is a pure function of (request seed, output index): each token draws one uniform from
a splitmix64 counter stream and inverts the CDF of the filtered distribution. So a seeded request
gives the same text whatever the batch, and a prefill node (output 0) and a decode node (1..)
draw from one per-request stream.

Penalties, logit_bias and min_tokens (shared/engine/sampling/penalties.py) reshape the logits
before the draw, then a structured output's grammar masks what it forbids
(shared/engine/sampling/grammar_rows.py);
logprobs (shared/engine/sampling/logprobs.py) are read from the raw logits, before any of that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.requests.request import LlmRequest
from shared.engine.sampling.grammar_rows import GrammarRows
from shared.engine.sampling.logprobs import TokenLogprobs, compute_logprobs
from shared.engine.sampling.penalties import PenaltyState
from shared.model.tokenizer import Tokenizer

_MASK64 = (1 << 64) - 1
# top_k up to this draws from a partial sort (topk) of this many candidates, not a full sort
TOPK_CANDIDATES = 1024


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_uniform(seed: int, index: int) -> float:
    """The `index`-th uniform in [0, 1) of the stream named by `seed`."""
    return (splitmix64(splitmix64(seed) ^ index) >> 11) / float(1 << 53)


def choice_seed(seed: int, index: int) -> int:
    """The stream of completion `index` of an n > 1 request; completion 0 keeps the seed."""
    return seed if index == 0 else splitmix64(seed ^ splitmix64(index)) >> 1


Choice = tuple[int, "TokenLogprobs | None"]  # a first token of another completion, its logprobs


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None unless its request asked
    # per row: for an n > 1 request's first token, completions 1..n-1's first tokens
    choices: list[list[Choice]]
    # batch position -> why its grammar failed: that row's token is not to be taken
    failed: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(
        self,
        max_num_sequences: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Iterable[int] = (),
        tokenizer: Tokenizer | None = None,  # structured outputs build their vocabulary from it
    ):
        self.max_num_sequences = max_num_sequences
        self.eos_token_ids = frozenset(eos_token_ids)
        self.dummy_slot_row = max_num_sequences  # scratch for padding rows, owned by nobody
        self.device = torch.device(device)
        # (tokens per step, seats + scratch row, beam)
        self.new_tokens = torch.zeros(
            (1, max_num_sequences + 1, 1), dtype=torch.long, device=self.device
        )
        self.temperature = torch.zeros(max_num_sequences, dtype=torch.float32)
        self.top_p = torch.ones(max_num_sequences, dtype=torch.float32)
        self.top_k = torch.zeros(max_num_sequences, dtype=torch.long)
        self.min_p = torch.zeros(max_num_sequences, dtype=torch.float32)
        self.seeds: list[int | None] = [None] * max_num_sequences
        self.logprobs_k: list[int | None] = [None] * max_num_sequences
        self.owner: list[str | None] = [None] * max_num_sequences
        self.penalties: PenaltyState | None = None  # allocated for the first request using them
        self.grammars = GrammarRows(max_num_sequences, tokenizer)
        self._check_invariants()

    def _check_invariants(self) -> None:
        assert self.new_tokens.shape[1] == self.max_num_sequences + 1
        for name in ("temperature", "top_p", "top_k", "min_p"):
            rows = getattr(self, name).shape[0]
            assert rows == self.max_num_sequences, f"{name} has {rows} rows"
        assert len(self.seeds) == len(self.owner) == self.max_num_sequences
        assert len(self.logprobs_k) == self.max_num_sequences
        assert self.penalties is None or self.penalties.rows == self.max_num_sequences

    def _slot_row(self, request: LlmRequest, vocab_size: int) -> int:
        seat = request.seq_slot
        if seat is None:
            raise RuntimeError(f"request {request.request_id} sampled without a seat")
        owner = self.owner[seat]
        if owner is None:
            self._setup(request, seat, vocab_size)
        elif owner != request.request_id:
            raise RuntimeError(f"seat {seat} holds stale state of {owner}")
        return seat

    def _setup(self, request: LlmRequest, seat: int, vocab_size: int) -> None:
        """Build the seat's rows from the request: its params, prompt and tokens so far."""
        params = request.sampling_params
        self.temperature[seat] = params.temperature
        self.top_p[seat] = params.top_p
        self.top_k[seat] = params.top_k
        self.min_p[seat] = params.min_p
        self.seeds[seat] = params.seed
        self.logprobs_k[seat] = params.logprobs
        if params.has_penalties:
            if self.penalties is None:
                # normal tensors: a release outside the step (an abort) writes them too
                with torch.inference_mode(False):
                    self.penalties = PenaltyState(self.max_num_sequences, vocab_size, self.device)
            self.penalties.setup(seat, request, self.eos_token_ids)
        if params.structured is not None:
            self.grammars.setup(seat, request, vocab_size)
        self.owner[seat] = request.request_id

    def release_request(self, request: LlmRequest) -> None:
        """Clear the request's per-seat state; runs before the seat goes back to the pool."""
        seat = request.seq_slot
        if seat is None or self.owner[seat] != request.request_id:
            return
        self.temperature[seat] = 0.0
        self.top_p[seat] = 1.0
        self.top_k[seat] = 0
        self.min_p[seat] = 0.0
        self.seeds[seat] = None
        self.logprobs_k[seat] = None
        if self.penalties is not None and self.penalties.active[seat]:
            self.penalties.clear(seat)
        self.grammars.clear(seat)
        self.owner[seat] = None
        self.new_tokens[:, seat] = 0

    def seq_slots_in_use(self) -> int:
        held = zip(self.owner, self.grammars.matchers, strict=True)
        return sum(o is not None or m is not None for o, m in held)

    def sample(self, requests: Sequence[LlmRequest | None], logits: torch.Tensor) -> list[int]:
        return self.sample_step(requests, logits).tokens

    def sample_step(
        self, requests: Sequence[LlmRequest | None], logits: torch.Tensor
    ) -> SampleOutput:
        """Logits [rows, vocab]; `None` rows are padding: sampled into the scratch row."""
        vocab = logits.shape[-1]
        rows = [self.dummy_slot_row if r is None else self._slot_row(r, vocab) for r in requests]
        raw = logits.float()
        live = [i for i, r in enumerate(requests) if r is not None]
        shaped = self.grammars.apply(rows, live, self._apply_penalties(requests, rows, raw), raw)
        # max().indices: argmax's result (the first maximum; NaN wins, as there) in a third of
        # argmax's time on CPU (32 x 49152 fp32: 0.5 vs 1.7 ms)
        tokens = shaped.max(dim=-1).indices
        seats = torch.tensor([rows[i] for i in live], dtype=torch.long)
        if live:
            temps = self.temperature[seats]
            random_rows = (temps > 0).nonzero().flatten()
            if random_rows.numel():
                idx = torch.tensor(live, dtype=torch.long)[random_rows]
                uniforms = [
                    stream_uniform(self.seeds[rows[i]] or 0, _output_index(requests[i]))
                    for i in idx.tolist()
                ]
                tokens[idx] = self._sample_random(
                    shaped[idx.to(shaped.device)].cpu(),
                    temps[random_rows],
                    self.top_k[seats[random_rows]],
                    self.top_p[seats[random_rows]],
                    torch.tensor(uniforms, dtype=torch.float64),
                    self.min_p[seats[random_rows]],
                ).to(tokens.device)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.new_tokens.device)
        self.new_tokens[0, row_index, 0] = tokens.to(self.new_tokens.device)
        token_list = tokens.tolist()
        self._record_penalties(rows, live, tokens)
        self.grammars.record(requests, rows, live, token_list)
        return SampleOutput(
            token_list,
            self._logprobs(rows, live, raw, token_list),
            self._draw_choices(requests, rows, shaped, raw),
            self.grammars.failed(rows, live),
        )

    def draw_drafts(
        self, request: LlmRequest, logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """What `request`'s seat draws from each row of `logits` [k, vocab] as if each were a
        step of its own, row j at the output index after the next token's + j: argmax when
        greedy, else its seeded stream under its temperature, top-k, top-p and min-p; with its
        logprobs where it asked. Changes no state (drafted requests hold no penalties and no
        grammar): a speculative step's verification (shared/engine/speculative/drafter.py)."""
        seat = request.seq_slot
        assert seat is not None and self.owner[seat] == request.request_id
        raw = logits.float()
        k = raw.shape[0]
        if float(self.temperature[seat]) > 0:
            base = _output_index(request) + 1
            seed = self.seeds[seat] or 0
            uniforms = [stream_uniform(seed, base + j) for j in range(k)]
            tokens = self._sample_random(
                raw.cpu(),
                self.temperature[seat].repeat(k),
                self.top_k[seat].repeat(k),
                self.top_p[seat].repeat(k),
                torch.tensor(uniforms, dtype=torch.float64),
                self.min_p[seat].repeat(k),
            ).tolist()
        else:
            tokens = raw.max(dim=-1).indices.tolist()
        top = self.logprobs_k[seat]
        if top is None:
            return tokens, [None] * k
        return tokens, list(compute_logprobs(raw, tokens, [top] * k))

    def _draw_choices(
        self,
        requests: Sequence[LlmRequest | None],
        rows: list[int],
        shaped: torch.Tensor,
        raw: torch.Tensor,
    ) -> list[list[Choice]]:
        """First tokens of completions 1..n-1 of n > 1 requests, from completion 0's logits
        (its penalty and grammar state hold for all: nothing was produced yet), each from its
        own stream (`choice_seed`), at output index 0."""
        out: list[list[Choice]] = [[] for _ in rows]
        for i, r in enumerate(requests):
            if r is None or not r.forks_pending:
                continue
            seat, m = rows[i], r.sampling_params.n - 1
            if self.temperature[seat] > 0:
                seeds = [choice_seed(self.seeds[seat] or 0, c) for c in range(1, m + 1)]
                tokens = self._sample_random(
                    shaped[i].expand(m, -1).cpu(),
                    self.temperature[seat].repeat(m),
                    self.top_k[seat].repeat(m),
                    self.top_p[seat].repeat(m),
                    torch.tensor([stream_uniform(s, 0) for s in seeds], dtype=torch.float64),
                    self.min_p[seat].repeat(m),
                ).tolist()
            else:
                tokens = [int(shaped[i].argmax())] * m
            k = self.logprobs_k[seat]
            lps: list[TokenLogprobs | None] = [None] * m
            if k is not None:
                lps = list(compute_logprobs(raw[i].expand(m, -1), tokens, [k] * m))
            out[i] = list(zip(tokens, lps, strict=True))
        return out

    def _penalty_rows(self, rows: list[int], live: list[int]) -> list[int]:
        if self.penalties is None:
            return []
        active = self.penalties.active.tolist()
        return [i for i in live if active[rows[i]]]

    def _apply_penalties(
        self, requests: Sequence[LlmRequest | None], rows: list[int], raw: torch.Tensor
    ) -> torch.Tensor:
        """Raw logits reshaped on rows using penalties, bias or min_tokens (a copy)."""
        live = [i for i, r in enumerate(requests) if r is not None]
        picked = self._penalty_rows(rows, live)
        if not picked:
            return raw
        assert self.penalties is not None
        dev = raw.device
        idx = torch.tensor(picked, dtype=torch.long, device=dev)
        seats = torch.tensor([rows[i] for i in picked], dtype=torch.long, device=dev)
        produced = torch.tensor(
            [len(requests[i].output_token_ids) for i in picked],  # type: ignore[union-attr]
            dtype=torch.long,
            device=dev,
        )
        if len(picked) == raw.shape[0]:  # every row: no gather / scatter
            shaped = raw.clone()
            self.penalties.apply(shaped, seats, produced)
            return shaped
        shaped = raw.clone()
        block = shaped[idx]  # [rows, vocab], a copy
        self.penalties.apply(block, seats, produced)
        shaped[idx] = block
        return shaped

    def _record_penalties(self, rows: list[int], live: list[int], tokens: torch.Tensor) -> None:
        picked = self._penalty_rows(rows, live)
        if not picked:
            return
        assert self.penalties is not None
        dev = self.penalties.active.device
        idx = torch.tensor(picked, dtype=torch.long, device=tokens.device)
        seats = torch.tensor([rows[i] for i in picked], dtype=torch.long, device=dev)
        self.penalties.record(seats, tokens[idx].to(dev))

    def _logprobs(
        self, rows: list[int], live: list[int], raw: torch.Tensor, tokens: list[int]
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(rows)
        picked = [i for i in live if self.logprobs_k[rows[i]] is not None]
        if not picked:
            return out
        idx = torch.tensor(picked, dtype=torch.long, device=raw.device)
        ks = [self.logprobs_k[rows[i]] or 0 for i in picked]
        for i, lp in zip(
            picked, compute_logprobs(raw[idx], [tokens[i] for i in picked], ks), strict=True
        ):
            out[i] = lp
        return out

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        temps: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniforms: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """Rows with a min_p lose their tokens below it first (-inf: no mass on any path).
        top_k <= TOPK_CANDIDATES: drawn from that many candidates (topk); no top-k / top-p: over
        the vocabulary in id order, unsorted (a stable sort per row was half of a batch-16
        SmolLM2 decode step); top-p alone: from those candidates when the nucleus lies within
        them; else a full sort. A row's path depends on its own parameters and logits only."""
        logits = _apply_min_p(logits, temps, min_p)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        few = (top_k > 0) & (top_k <= TOPK_CANDIDATES)
        no_k = ~few & ((top_k <= 0) | (top_k >= logits.shape[-1]))
        plain = no_k & (top_p >= 1.0)
        full_sort = ~few & ~plain
        idx = plain.nonzero().flatten()
        if idx.numel():
            out[idx] = _draw_unfiltered(logits[idx], temps[idx], uniforms[idx])
        idx = (no_k & ~plain).nonzero().flatten()
        if idx.numel():
            tokens, covered = _draw_nucleus(logits[idx], temps[idx], top_p[idx], uniforms[idx])
            out[idx[covered]] = tokens[covered]
            full_sort[idx[covered]] = False  # the others' nucleus is wider: the full sort
        for rows, width in ((few, TOPK_CANDIDATES), (full_sort, None)):
            idx = rows.nonzero().flatten()
            if idx.numel():
                out[idx] = _draw(
                    logits[idx], temps[idx], top_k[idx], top_p[idx], uniforms[idx], width
                )
        return out


def _output_index(request: LlmRequest | None) -> int:
    """The seeded stream's index of the token `request` samples next: its own outputs, after
    those of the answer it continues (SamplingParams.output_index_offset)."""
    assert request is not None  # a live row
    return request.sampling_params.output_index_offset + len(request.output_token_ids)


def _apply_min_p(logits: torch.Tensor, temps: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p, before top-k and top-p: a token whose probability after temperature is
    below min_p x the top token's is masked. In logits: p_i / p_max = exp((l_i - l_max) / T),
    so the bar is l_max + T ln(min_p) (no softmax needed). Rows without min_p are untouched."""
    rows = (min_p > 0).nonzero().flatten()
    if not rows.numel():
        return logits
    picked = logits[rows]
    bar = picked.amax(dim=-1, keepdim=True) + temps[rows, None] * min_p[rows, None].log()
    out = logits.clone()
    out[rows] = picked.masked_fill(picked < bar, float("-inf"))
    return out


def _draw_nucleus(
    logits: torch.Tensor, temps: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p without top-k from the TOPK_CANDIDATES most likely tokens, their probabilities
    normalised over the whole vocabulary (so the nucleus is the full sort's). Returns (tokens,
    covered): a row whose candidates hold less than top_p of the mass is not covered (its
    token here is meaningless) and needs the full sort."""
    scaled = logits / temps[:, None]
    width = min(TOPK_CANDIDATES, logits.shape[-1])
    top, ids = scaled.topk(width, dim=-1)  # [rows, width], descending
    log_norm = torch.logsumexp(scaled.double(), dim=-1, keepdim=True)
    probs, mass = _nucleus((top.double() - log_norm).exp(), top_p)
    covered = mass[:, -1] >= top_p.double()
    return ids.gather(1, _invert_cdf(probs, uniforms)).flatten(), covered


def _draw_unfiltered(
    logits: torch.Tensor, temps: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Invert the CDF of the temperature-scaled distribution, taken in token-id order, at each
    row's uniform (masked tokens, -inf, have no mass and are never drawn)."""
    # One [rows, vocab] buffer, worked in place, and no normalisation (the inversion scales its
    # target by the total mass): the softmax, its copy and the cumsum's were 6 MB temporaries per
    # 16 rows, each freshly page-faulted: 5.5-6.0 -> 2.1 ms for 16 rows of SmolLM2's vocabulary.
    weights = (logits / temps[:, None]).double()
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    return _invert_cdf(weights, uniforms, in_place=True).flatten()


def _draw(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    width: int | None,
) -> torch.Tensor:
    """Invert the CDF of the temperature-scaled, top-k / top-p filtered distribution at each
    row's uniform. `width`: look only at that many most likely candidates (None: all)."""
    vocab = logits.shape[-1]
    scaled = logits / temps[:, None]  # [rows, vocab]
    if width is not None and width < vocab:
        sorted_logits, sorted_ids = scaled.topk(width, dim=-1)  # [rows, width], descending
    else:
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    n = sorted_logits.shape[-1]
    ranks = torch.arange(n)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=n), torch.full_like(top_k, n))
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs, _ = _nucleus(torch.softmax(sorted_logits.double(), dim=-1), top_p)
    return sorted_ids.gather(1, _invert_cdf(probs, uniforms)).flatten()


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, most likely first, zeroed past the smallest prefix whose mass reaches top_p,
    the top token always kept; the running mass of the unzeroed probs)."""
    mass = probs.cumsum(dim=-1)
    return probs.masked_fill(mass - probs >= top_p.double()[:, None], 0.0), mass


def _invert_cdf(
    probs: torch.Tensor, uniforms: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """[rows, 1]: per row, the first index whose cumulative mass exceeds uniform x total.
    `probs` may be unnormalised; `in_place` turns it into its own CDF."""
    cdf = probs.cumsum_(dim=-1) if in_place else probs.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    return torch.searchsorted(cdf, targets[:, None], right=True).clamp(max=probs.shape[-1] - 1)
