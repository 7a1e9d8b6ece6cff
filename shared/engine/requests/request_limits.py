"""What a node can ever serve: a request outside these limits is rejected before anything is
allocated, with a message naming the field."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from shared.cdiv import cdiv
from shared.engine.errors import RequestRejected
from shared.engine.requests.multimodal import MultimodalPrompt, PromptImage
from shared.engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # the whole KV pool
    max_num_sequences: int  # seats
    context_only: bool  # a prefill node holds the prompt only
    # the LoRA adapters the model serves now (they may be loaded and unloaded while it runs)
    lora_adapters: Callable[[], Collection[str]] = field(default=lambda: ())
    # vision models: the placeholder token an image's embeddings replace, and the tower's
    # spatial merge (placeholders per image = patches / merge**2); None: text only
    image_token_id: int | None = None
    image_merge: int = 1

    def multimodal(
        self, prompt_token_ids: Sequence[int], images: Sequence[PromptImage]
    ) -> MultimodalPrompt | None:
        """The prompt's images laid out (None for a text prompt); RequestRejected when the
        model takes no images or the placeholders and the images disagree."""
        if self.image_token_id is None:
            if images:
                raise RequestRejected("images: this model takes text only")
            return None
        if not images:
            if self.image_token_id in prompt_token_ids:
                raise RequestRejected(
                    f"prompt holds image placeholder tokens (id {self.image_token_id}) but no "
                    "images came with it"
                )
            return None
        try:
            return MultimodalPrompt.build(
                prompt_token_ids, images, self.image_token_id, self.image_merge
            )
        except ValueError as e:
            raise RequestRejected(f"images: {e}") from None

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejected naming the field."""
        try:
            params.validate(self.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        if not prompt_token_ids:
            raise RequestRejected("prompt is empty: send non-empty text or token_ids")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is out of range [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt_token_ids)} tokens) + sampling.max_tokens "
                f"({params.max_tokens}) = {total} exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        self._check_fits_alone(prompt_token_ids, params)
        self._check_adapter(params.lora_adapter)

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is None:
            return
        loaded = self.lora_adapters()
        if adapter not in loaded:
            raise RequestRejected(
                f"lora_adapter: LoRA adapter {adapter!r} is not loaded on this node (loaded: "
                f"{sorted(loaded)}); start it with --lora-modules {adapter}=PATH"
            )

    def _check_fits_alone(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Never admissible: it could not finish even alone on this node."""
        tokens = len(prompt_token_ids) + (0 if self.context_only else params.max_tokens - 1)
        need = cdiv(tokens, self.block_size)
        if not self.context_only:
            # n completions share only the prompt's full blocks
            need += (params.n - 1) * (need - len(prompt_token_ids) // self.block_size)
            if params.n > self.max_num_sequences:
                raise RequestRejected(
                    f"sampling.n ({params.n}) exceeds this node's {self.max_num_sequences} seats"
                )
        if need > self.num_blocks:
            what = "prompt" if self.context_only else "prompt + sampling.max_tokens"
            raise RequestRejected(
                f"request needs {need} KV blocks for its {what} ({tokens} tokens) but this "
                f"node's whole pool has {self.num_blocks}; it could never "
                "be served here: shorten the prompt or max_tokens"
            )
