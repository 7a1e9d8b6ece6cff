"""A decoder-only causal LM over the paged KV pool: the one model class every family builds,
configured by `ModelConfig` (shared/model/registry.py maps checkpoints to it).

Parameter names equal the Hugging Face state-dict keys (`model.layers.0.self_attn.q_proj.weight`,
...), so most checkpoints load with a plain name-for-name copy; families that fuse tensors in
their checkpoints say how to split them (shared/model/family.py).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.attention import GatherScratch
from shared.model.config import ModelConfig
from shared.model.decode_stack import DecodeStack
from shared.model.decoder_layer import DecoderLayer
from shared.model.forward_batch import ForwardBatch
from shared.model.gemm import PackedGemm
from shared.model.linear import Embedding, Linear
from shared.model.lora_bank import LoraBank, LoraStep
from shared.model.norms import make_norm
from shared.model.rotary import RotaryEmbedding
from shared.model.step_context import LayerHook, StepContext
from shared.model.vision.vision_tower import build_vision_tower


class DecoderStack(nn.Module):
    """The `model.` prefix of the Hugging Face state dict."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        scale = c.hidden_size**0.5 if c.scale_embeddings else None
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, device, dtype, scale)
        self.layers = nn.ModuleList(DecoderLayer(c, i, device, dtype) for i in range(c.num_layers))
        self.norm = make_norm(c.norm, c.hidden_size, c.rms_norm_eps, device, dtype)
        self.rotary_emb = RotaryEmbedding(c, device)
        self.local_rotary_emb = (
            None
            if c.local_rope_theta is None
            else RotaryEmbedding(c, device, theta=c.local_rope_theta)
        )


class Model(nn.Module):
    """A `*ForCausalLM` of any family pdserve serves, over a paged KV pool."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.model = DecoderStack(config, device, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear.empty(config.hidden_size, config.vocab_size, False, device, dtype)
        self._head = PackedGemm(self.lm_head_weight(), None)
        self._scratch = GatherScratch()
        # the native decode stack implements exactly a Llama layer, nothing else
        self._stack = DecodeStack(self.model.layers) if config.llama_layers else None
        self.lora: LoraBank | None = None  # set by the loader with --lora-modules / --max-loras
        # the vision tower (Qwen2-VL's `visual.`), whose embeddings replace image placeholders
        self.visual = (
            None if config.vision is None else build_vision_tower(config.vision, device, dtype)
        )
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        batch: ForwardBatch,
        kv_pool: torch.Tensor,
        *,
        all_logits: bool = False,
        layer_hook: LayerHook | None = None,
        scratch: GatherScratch | None = None,
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing their K/V into `kv_pool`.

        Returns fp32 logits: `[num_seqs, vocab]` for each sequence's last new token, or
        `[num_tokens, vocab]` for every new token with `all_logits`. `layer_hook(i)` runs right
        after layer i has written this batch's K/V into `kv_pool[i]`, before layer i's attention.
        On CUDA the write is only *enqueued* on the current stream at that point: a hook that
        reads the pool from another stream or over the network must order itself after it
        (e.g. record an event on the current stream). `scratch` replaces the model's own K/V
        gather buffer (a CUDA graph must own the memory its kernels write).
        """
        self._check_pool(kv_pool)
        with torch.inference_mode():
            x = self.model.embed_tokens(batch.input_ids)
            if batch.embeds is not None:
                x.index_copy_(0, batch.embed_rows, batch.embeds.to(x.dtype))
            rope = self.model.rotary_emb(batch.rope_input, x.dtype)
            stack = self._stack
            lora = self._lora_step(batch)
            if (
                lora is None
                and layer_hook is None
                and stack is not None
                and stack.usable(batch, x, kv_pool)
            ):
                pending = stack.run(x, batch, rope, kv_pool)
            else:
                local = self.model.local_rotary_emb
                step = StepContext(
                    batch,
                    kv_pool,
                    rope,
                    layer_hook,
                    scratch or self._scratch,
                    None if local is None else local(batch.rope_input, x.dtype),
                    lora,
                )
                pending = None
                for layer in self.model.layers:
                    pending = layer(x, pending, step)
            if not all_logits:
                last = batch.last_token_index
                x = x.index_select(0, last)
                pending = None if pending is None else pending.index_select(0, last)
            logits = self._head(self.model.norm.add_forward(x, pending))
            cap = self.config.final_logit_softcap
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            return logits.float()

    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters this model serves now."""
        return frozenset(() if self.lora is None else self.lora.slots)

    def _lora_step(self, batch: ForwardBatch) -> LoraStep | None:
        if batch.lora is None:
            return None
        if self.lora is None:
            raise ValueError("the batch names LoRA adapters but the model has no adapter slots")
        return self.lora.step(batch.lora)

    def _check_pool(self, kv_pool: torch.Tensor) -> None:
        c = self.config
        shape = tuple(kv_pool.shape)
        planes, heads, dim = c.kv_row_shape
        expected = (c.num_layers, planes, heads, dim)
        if len(shape) != 6 or (*shape[:2], *shape[4:]) != expected:
            raise ValueError(
                f"kv_pool shape {shape} does not match the model: expected "
                f"(layers={c.num_layers}, {planes}, blocks, block_size, kv_heads={heads}, "
                f"head_dim={dim})"
            )
        if kv_pool.device != self.device:
            raise ValueError(f"kv_pool is on {kv_pool.device}, model on {self.device}")
