"""`--speculative-config`, spelled as vLLM spells it: which proposer drafts tokens for a request
and how many a step verifies."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts verified per step (k): a step yields 1..k+1 tokens
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up in the request's tokens
    prompt_lookup_min: int = 1
    model: str = ""  # draft_model: what pdserve loads for it (--model's spellings), same tokenizer

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported; supported: "
                f"{', '.join(METHODS)}"
            )
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError(
                'speculative "model" names the draft model of method "draft_model" (a model '
                "pdserve loads, with the served model's tokenizer), and only of that method"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`; ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known {sorted(known)}")
        values = {k: raw[k] for k in known if k in raw}
        for key in ("method", "model"):
            if key in values and not isinstance(values[key], str):
                raise ValueError(f"--speculative-config: {key} must be a string")
        for key in known - {"method", "model"}:
            if key in values and not isinstance(values[key], int):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        config = cls(**values)
        config.validate()
        return config
