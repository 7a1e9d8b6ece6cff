"""The colocated offline API: `LLM(EngineConfig(model=...)).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.config import EngineConfig
from shared.engine.core import EngineCore, RequestOutput
from shared.engine.requests.multimodal import PromptImage
from shared.engine.requests.output import TokenDelta
from shared.engine.requests.request import FinishReason, LlmRequest
from shared.engine.roles.decode_role import DecodeSettings
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import LoadedModel


class LLM:
    """Colocated engine: one process does prefill and decode. The correctness and performance
    baseline for the disaggregated path."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.core = EngineCore(config or EngineConfig(), loaded, role=DecodeSettings())

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.core.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str = "",
        images: Sequence[PromptImage] = (),
    ) -> LlmRequest:
        return self.core.add_request(self.encode(prompt), params, request_id, images)

    def step(self) -> list[TokenDelta]:
        return self.core.step()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per completion: a prompt with n > 1 gives n consecutive outputs
        (index 0..n-1)."""
        params_list = self._expand_params(prompts, sampling_params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        outputs = {
            (r.request_id, i): self._empty_output(r, i)
            for r in requests
            for i in range(r.sampling_params.n)
        }
        while self.core.has_work:
            for delta in self.core.step():
                out = outputs.get((delta.request_id, delta.index))
                if out is None:
                    continue
                out.token_ids.extend(delta.token_ids)
                out.text += delta.text
                if out.logprobs is not None:
                    out.logprobs.extend(delta.logprobs or ())
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.finish_reason is not None:
                    out.finish_reason = delta.finish_reason
                if delta.error is not None:
                    out.error = delta.error
        for r in requests:  # the group's prompt logprobs come with completion 0
            for i in range(1, r.sampling_params.n):
                outputs[(r.request_id, i)].prompt_logprobs = outputs[
                    (r.request_id, 0)
                ].prompt_logprobs
            for i in range(r.sampling_params.n):
                outputs[(r.request_id, i)].cached_tokens = r.cached_tokens
                outputs[(r.request_id, i)].num_preemptions = r.num_preemptions
        return list(outputs.values())

    @staticmethod
    def _empty_output(request: LlmRequest, index: int) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=[],
            text="",
            finish_reason=FinishReason.ABORTED,
            cached_tokens=0,
            num_preemptions=0,
            logprobs=[] if request.sampling_params.logprobs is not None else None,
            index=index,
        )

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
