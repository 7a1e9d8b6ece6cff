"""Per-request sampling parameters, validated before anything is allocated."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from shared.engine.sampling.structured_output import StructuredOutput
from shared.engine.scheduling.service_level import ServiceLevel

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Below this (but above 0) logits / temperature overflows float32 and sampling draws from NaN
# probabilities (found by fuzzing: 1e-40 sampled token 258 every step instead of the argmax).
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top-k alternatives per position (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off (shared.serving.wire maps the wire's 0 to 1)
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; below min_p x the top token's probability is never drawn
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Logprobs are those of the model's raw distribution (log_softmax of the logits, before
    # logit_bias, penalties, temperature, top-k and top-p), as vLLM returns by default.
    logprobs: int | None = None  # per generated token: None = off, k = the chosen + top k
    prompt_logprobs: int | None = None  # per prompt token (from the second): None = off
    repetition_penalty: float = 1.0  # transformers' semantics, prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI's semantics over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many were generated
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # finish with "stop"
    n: int = 1  # completions of the one prompt
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (vLLM's)
    # a grammar every output token is drawn under (shared/engine/sampling/grammar_rows.py); None:
    # free
    structured: StructuredOutput | None = None
    # the seeded stream's index of the first token sampled: a request continuing an answer whose
    # first tokens were produced elsewhere (now at the end of its prompt) draws what the
    # uninterrupted request would have
    output_index_offset: int = 0
    # how many of the prompt's last tokens are this answer's first tokens, already streamed by
    # the call it continues: their text is not released again (only what that call held back:
    # a partial character, a possible stop string's start), and a stop string may begin in it
    continued_tokens: int = 0
    # priority and latency targets: admission's, not the sampler's (service_level.py)
    service: ServiceLevel = field(default_factory=ServiceLevel)
    # the LoRA adapter (a --lora-modules name) the model runs this request with; None: the base.
    # Not the sampler's either: it rides here because these params go wherever the request goes
    # (engine, Prefill RPC, forks), and its prefix-cache blocks are keyed by it.
    lora_adapter: str | None = None

    def __hash__(self) -> int:  # logit_bias is a dict; params are compared, rarely hashed
        return hash((self.max_tokens, self.seed, self.stop, self.n))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs per-seat token state for this request."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field (the gRPC layer: INVALID_ARGUMENT)."""
        for f in fields(self):
            value = getattr(self, f.name)
            # inf would pass every range check below and then sample garbage (or NaN probs)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"sampling.{f.name} must be a finite number, got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(
                f"sampling.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in [0, 1] (0 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"sampling.seed must fit in uint64, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"sampling.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} allowed"
            )
        for s in self.stop:
            if not s:
                raise ValueError("sampling.stop contains an empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"sampling.stop string of {len(s)} chars exceeds {MAX_STOP_STRING_CHARS}"
                )
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_token_ids(vocab_size)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"sampling.n must be in [1, {MAX_N}], got {self.n}")
        self.service.validate()
        if self.structured is not None:
            self._validate_structured(self.structured)

    def _validate_structured(self, structured: StructuredOutput) -> None:
        structured.validate()
        # the grammar ends at EOS: with EOS ignored or masked the matcher could be left with no
        # token it allows
        if self.ignore_eos:
            raise ValueError("sampling.ignore_eos cannot be combined with a structured output")
        if self.min_tokens:
            raise ValueError("sampling.min_tokens cannot be combined with a structured output")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    def _validate_penalties(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(
                f"sampling.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # OpenAI's range; also rejects NaN
                raise ValueError(f"sampling.{name} must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"sampling.logit_bias has {len(self.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS} allowed"
            )
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"sampling.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"sampling.stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} allowed"
            )

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        if vocab_size is None:
            return
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"sampling.{name} token id {bad} is out of range [0, {vocab_size})"
                )

    def continued(self, prompt: list[int], done: list[int]) -> tuple[list[int], SamplingParams]:
        """The prompt and params of a request that continues an answer whose first tokens,
        `done`, some earlier call already streamed: they follow the prompt, seeded draws go on
        at their output index, max_tokens and min_tokens count what is left. ValueError: the
        answer cannot be continued."""
        if not done:
            return prompt, self
        if self.n > 1:
            raise ValueError("an answer with n > 1 cannot be continued")
        if len(done) >= self.max_tokens:
            raise ValueError(
                f"continuation has {len(done)} tokens: max_tokens {self.max_tokens} leaves none "
                "to generate"
            )
        return prompt + done, replace(
            self,
            max_tokens=self.max_tokens - len(done),
            min_tokens=max(0, self.min_tokens - len(done)),
            output_index_offset=self.output_index_offset + len(done),
            continued_tokens=self.continued_tokens + len(done),
        )

    def continued_part(self, prompt: Sequence[int]) -> list[int]:
        """The answer's tokens an earlier call streamed, at the end of this request's prompt
        (`continued`): a grammar has already read them."""
        if not self.continued_tokens:
            return []
        return list(prompt[max(0, len(prompt) - self.continued_tokens) :])

    def with_resolved_seed(self) -> SamplingParams:
        """Fix the seed at admission so that every node draws from the same per-request stream."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))
