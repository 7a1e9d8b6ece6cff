"""The colocated offline API: `LLM(EngineConfig(model=...)).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestOutput
from shared.engine.logprobs import TokenLogprobs
from shared.engine.output import TokenDelta
from shared.engine.request import FinishReason, LlmRequest
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel


class LLM:
    """Colocated engine: one process does prefill and decode. The correctness and performance
    baseline for the disaggregated path."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.core = EngineCore(config or EngineConfig(), loaded)

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.core.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str = ""
    ) -> LlmRequest:
        return self.core.add_request(self.encode(prompt), params, request_id)

    def step(self) -> list[TokenDelta]:
        return self.core.step()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params_list = self._expand_params(prompts, sampling_params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        texts = {r.request_id: "" for r in requests}
        logprobs: dict[str, list[TokenLogprobs]] = {r.request_id: [] for r in requests}
        prompt_logprobs: dict[str, list[TokenLogprobs | None] | None] = {}
        while self.core.has_work:
            for delta in self.core.step():
                if delta.request_id in texts:
                    texts[delta.request_id] += delta.text
                    logprobs[delta.request_id].extend(delta.logprobs or ())
                    if delta.prompt_logprobs is not None:
                        prompt_logprobs[delta.request_id] = delta.prompt_logprobs
        return [
            RequestOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                text=texts[r.request_id],
                finish_reason=r.finish_reason or FinishReason.ABORTED,
                cached_tokens=r.cached_tokens,
                num_preemptions=r.num_preemptions,
                logprobs=logprobs[r.request_id] if r.sampling_params.logprobs is not None else None,
                prompt_logprobs=prompt_logprobs.get(r.request_id),
            )
            for r in requests
        ]

    @staticmethod
    def _expand_params(
        prompts: Sequence[object],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return list(sampling_params)

    def check_conservation(self) -> None:
        self.core.check_conservation()
