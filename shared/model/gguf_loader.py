"""Serve a GGUF file (llama.cpp's format): config from metadata, weights dequantized by `gguf`.

Architectures `llama` (Llama, Mistral-style, SmolLM2), `qwen2` and `qwen3` (per-head q/k norms as
`attn_q_norm` / `attn_k_norm`), `gemma2`, `gemma3`, `phi3` (their metadata and tensor
conventions: shared/model/gguf_arch.py), and the experts of `qwen3moe` and `deepseek2` (with
latent attention: shared/model/gguf_moe.py); shared/model/registry.py lists them. The config comes
from the `{arch}.*` metadata (context length, sizes, heads, KV heads, rope base, norm epsilon);
biases and tied embeddings from which tensors exist (no `output.weight`: the head reuses
`token_embd`).
Tensors of every type `gguf.quants` can dequantize are expanded to fp32 and cast to the node's
dtype. llama.cpp stores llama's Q/K projection rows permuted for its interleaved rope
(convert_hf_to_gguf.py's `permute`); the permutation is undone exactly, row for row, so the
Hugging Face-layout model here computes what llama.cpp computes. qwen2 is stored unpermuted.
A `rope_freqs.weight` tensor (llama 3 style frequency factors) divides the inverse frequencies.

Every problem (unknown architecture or tensor type, missing / unexpected / misshapen tensor,
truncated file) raises a `GgufError` naming the file, before any request is served.
"""

from __future__ import annotations

import os
import re
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import _type_traits, dequantize
from tqdm import tqdm

from shared.model import gguf_arch, gguf_moe
from shared.model.causal_lm import Model
from shared.model.config import ModelConfig
from shared.model.gguf_file import GgufFile
from shared.model.registry import GGUF_ARCHITECTURES, config_from_hf

ARCHITECTURES = GGUF_ARCHITECTURES
# Only F32 and F16 are handled outside `_type_traits` by `gguf.quants.dequantize`.
DEQUANTIZABLE = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits.keys()}
)
ROPE_FREQS = "rope_freqs.weight"
LOAD_THREADS = 4
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face state-dict key for llama.cpp tensor `name`, None if there is none."""
    match = _BLOCK.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}" if part in _LAYER else None
    base, _, kind = name.rpartition(".")
    return f"{_TOP[base]}.{kind}" if base in _TOP and kind in ("weight", "bias") else None


# ----------------------------------------------------------------------------------- config


def gguf_model_config(gguf: GgufFile, *, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise gguf.error(f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    if arch in gguf_arch.ARCHES or arch in gguf_moe.ARCHES:
        mapping = gguf_arch if arch in gguf_arch.ARCHES else gguf_moe
        try:
            return config_from_hf(mapping.hf_config(gguf, eos_token_ids))
        except ValueError as exc:
            raise gguf.error(f"describes an unsupported model: {exc}") from exc
    _check_rope_scaling(gguf, arch)
    heads = int(gguf.require(f"{arch}.attention.head_count"))
    hidden = int(gguf.require(f"{arch}.embedding_length"))
    head_dim = int(gguf.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = gguf.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise gguf.error(f"partial rope ({rope_dims} of {head_dim} dims) is not supported")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise gguf.error("lacks tensor 'token_embd.weight'")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else int(embed.shape[1]))
    has = gguf.tensors.__contains__
    try:
        return ModelConfig(
            architecture=ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(gguf.require(f"{arch}.feed_forward_length")),
            num_layers=int(gguf.require(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(gguf.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings=not has("output.weight"),
            attention_bias=has("blk.0.attn_q.bias"),
            attention_out_bias=has("blk.0.attn_output.bias"),
            mlp_bias=has("blk.0.ffn_gate.bias"),
            qk_norm=has("blk.0.attn_q_norm.weight"),
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_token_ids,
            pad_token_id=gguf.get("tokenizer.ggml.padding_token_id"),
        )
    except ValueError as exc:
        raise gguf.error(f"describes an unsupported model: {exc}") from exc


def _check_rope_scaling(gguf: GgufFile, arch: str) -> None:
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    factor = float(gguf.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind not in ("none", "") and factor != 1.0:
        raise gguf.error(f"unsupported rope scaling {kind!r} (factor {factor})")


def gguf_eos_token_ids(gguf: GgufFile) -> tuple[int, ...]:
    """Every end-of-generation id the file declares: eos, eot (end of turn), eom (end of
    message), in that order, without repeats."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


# llama.cpp's recommended-sampling keys, as the request defaults generation_config.json gives
_SAMPLING_KEYS = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.min_p": ("min_p", float),
    "general.sampling.penalty_repeat": ("repetition_penalty", float),
}


def gguf_generation_defaults(gguf: GgufFile) -> dict[str, Any]:
    """Sampling defaults the file recommends (`general.sampling.*`); empty when it names none."""
    out: dict[str, Any] = {}
    for key, (name, kind) in _SAMPLING_KEYS.items():
        value = gguf.get(key)
        if value is not None:
            out[name] = kind(value)
    return out


# ---------------------------------------------------------------------------------- weights


def load_gguf_weights(model: Model, gguf: GgufFile, *, progress: bool = True) -> None:
    """Dequantize every tensor into its parameter, on a few threads (numpy and torch release
    the GIL, so both cores work), at most a few tensors in flight so peak memory stays about
    one model in the node's dtype."""
    params = dict(model.named_parameters())
    plan = _tensor_plan(gguf, params, model.config)
    bar = tqdm(
        total=len(plan),
        desc=f"loading {gguf.path.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5,
        leave=False,
    )

    def store(tensor: ReaderTensor, hf_names: list[str]) -> None:
        values = torch.from_numpy(_dequantized(gguf, tensor, model.config))
        if gguf_moe.is_split_kv_b(tensor.name):
            try:
                gguf_moe.fill_kv_b(tensor.name, values, params[hf_names[0]], model.config)
            except ValueError as exc:
                raise gguf.error(str(exc)) from exc
            return
        if values.dim() == 3:  # stacked experts [E, rows, cols]: each expert's rows in turn
            values = values.flatten(0, 1)
        parts = [params[name] for name in hf_names]
        # a fused tensor (Phi-3's attn_qkv) stacks its parameters' rows
        expected = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if tuple(values.shape) != expected:
            raise gguf.error(
                f"tensor {tensor.name!r} has shape {tuple(values.shape)}, the metadata "
                f"implies {expected} for {hf_names}"
            )
        rows = values.split([p.shape[0] for p in parts])
        with torch.no_grad():
            for param, part in zip(parts, rows, strict=True):
                param.copy_(part)  # rows of a fused buffer never overlap

    workers = max(1, min(LOAD_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="gguf-load") as pool:
        pending: deque[Future[None]] = deque()
        for tensor, hf_name in plan:
            pending.append(pool.submit(store, tensor, hf_name))
            if len(pending) > 2 * workers:
                pending.popleft().result()
                bar.update()
        while pending:
            pending.popleft().result()
            bar.update()
    bar.close()
    factors = gguf.tensors.get(ROPE_FREQS)
    if factors is not None:
        # llama.cpp divides each rotary frequency by its factor (ggml_rope_ext's freq_factors).
        inv_freq = model.model.rotary_emb.inv_freq
        inv_freq.div_(torch.from_numpy(_dequantized(gguf, factors, model.config)).to(inv_freq))


def _tensor_plan(
    gguf: GgufFile, params: dict[str, Any], config: ModelConfig
) -> list[tuple[ReaderTensor, list[str]]]:
    plan: list[tuple[ReaderTensor, list[str]]] = []
    unknown: list[str] = []
    targets = _targets(gguf, params, config)
    for name, tensor in gguf.tensors.items():
        if name == ROPE_FREQS:
            continue
        hf_names = targets(name)
        if hf_names == ["lm_head.weight"] and config.tie_word_embeddings:
            continue
        if not hf_names or any(n not in params for n in hf_names):
            unknown.append(name)
            continue
        if tensor.tensor_type not in DEQUANTIZABLE:
            raise gguf.error(
                f"tensor {name!r} has type {tensor.tensor_type.name}, which gguf cannot "
                f"dequantize; supported: {sorted(t.name for t in DEQUANTIZABLE)}"
            )
        plan.append((tensor, hf_names))
    if unknown:
        raise gguf.error(f"has tensor(s) the {gguf.architecture} model does not use: {unknown[:5]}")
    missing = sorted(set(params) - {hf for _, names in plan for hf in names})
    if missing:
        raise gguf.error(
            f"lacks tensor(s) for {missing[:5]}" + (" ..." if len(missing) > 5 else "")
        )
    return plan


def _targets(
    gguf: GgufFile, params: dict[str, Any], config: ModelConfig
) -> Callable[[str], list[str]]:
    """GGUF tensor name -> the parameters it fills ([] for none)."""
    arch = gguf.architecture
    if arch not in gguf_arch.ARCHES and arch not in gguf_moe.ARCHES:
        return lambda name: [hf] if (hf := hf_tensor_name(name)) else []
    try:
        if arch in gguf_moe.ARCHES:
            targets = gguf_moe.tensor_targets(gguf, config.architecture, params)
        else:
            targets = gguf_arch.tensor_targets(arch, config.architecture, params)
    except ValueError as exc:
        raise gguf.error(str(exc)) from exc
    return lambda name: targets.get(name, [])


def _dequantized(gguf: GgufFile, tensor: ReaderTensor, config: ModelConfig) -> np.ndarray:
    values = dequantize(tensor.data, tensor.tensor_type)
    values = values.reshape([int(d) for d in reversed(tensor.shape)])
    if gguf.architecture in gguf_arch.NORM_SHIFTED and tensor.name.endswith("norm.weight"):
        values = values - 1.0  # stored as 1 + weight (gguf_arch.py)
    if gguf.architecture == "llama" and tensor.name.startswith("blk."):
        part = tensor.name.split(".")[2]
        if part == "attn_q":
            values = unpermute_rope_rows(values, config.num_heads)
        elif part == "attn_k":
            values = unpermute_rope_rows(values, config.num_kv_heads)
    values = np.ascontiguousarray(values, dtype=np.float32)
    # F32 tensors come back as views of the read-only memory map; torch wants a writable array.
    return values if values.flags.writeable else values.copy()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `permute(w, n_head)`: per head it stored row pairs interleaved
    (x0, y0, x1, y1, ...); Hugging Face's rotate_half wants the halves (x0.., y0..)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of rope pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
