"""A LoRA adapter in llama.cpp's GGUF form (`convert_lora_to_gguf.py`: `general.type` =
"adapter", `adapter.type` = "lora", `adapter.lora.alpha`), read with the `gguf` package.

Each targeted projection holds `blk.N.<part>.weight.lora_a` ([r, in]) and `.lora_b` ([out, r]);
any type `gguf.quants` dequantizes is read, in fp32. Numerics follow llama.cpp's
`llama_adapter_lora`: scale `alpha / r` (1 when alpha is 0). For the `llama` architecture the
converter permuted lora_b's Q and K rows as it permutes the base weights, so they are unpermuted
here as the base loader does (shared/model/gguf_loader.py).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from shared.model.gguf_file import GgufError, GgufFile, open_gguf
from shared.model.gguf_loader import hf_tensor_name, unpermute_rope_rows
from shared.model.lora_adapter import SUPPORTED_MODULES, AdapterError, LoraAdapter, checked_module

# a base tensor's name (blk.N.attn_q.weight: gguf_loader.hf_tensor_name reads it) and A or B
_KEY = re.compile(r"(blk\.\d+\.\w+\.weight)\.lora_([ab])")


def read_gguf_adapter(
    name: str,
    path: str | Path,
    shapes: Mapping[tuple[int, str], tuple[int, int]],
    max_rank: int,
    heads: tuple[int, int],
) -> LoraAdapter:
    """Read and validate the GGUF adapter file `path`; `shapes` as `read_adapter` takes them,
    `heads` the base model's (query heads, KV heads), for undoing llama's Q/K row permutation."""
    try:
        g = open_gguf(path)
    except GgufError as e:
        raise AdapterError(str(e)) from None
    if g.get("general.type") != "adapter" or g.get("adapter.type") != "lora":
        raise AdapterError(
            f"{g.path}: general.type {g.get('general.type')!r}, adapter.type "
            f"{g.get('adapter.type')!r}: not a LoRA adapter (llama.cpp's convert_lora_to_gguf.py "
            "writes 'adapter' and 'lora')"
        )
    alpha = float(g.get("adapter.lora.alpha", 0.0))
    permuted = g.architecture == "llama"
    modules = {}
    for key, (a, b) in _pairs(g, shapes).items():
        rank = a.shape[0]
        if permuted and key[1] in ("q_proj", "k_proj"):
            b = unpermute_rope_rows(b, heads[0] if key[1] == "q_proj" else heads[1])
        config = {"r": rank, "lora_alpha": alpha or rank}  # alpha 0: scale 1, as llama.cpp
        tensors = torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(b.copy())
        modules[key] = checked_module(g.path, config, key, *tensors, shapes[key], max_rank)
    if not modules:
        raise AdapterError(f"{g.path}: no lora_a/lora_b tensors of a supported projection")
    return LoraAdapter(
        name=name,
        path=g.path,
        rank=max(m.a.shape[0] for m in modules.values()),
        base_model=g.get("general.base_model.0.name"),
        modules=modules,
        fingerprint=_fingerprint(g.path),
    )


def _pairs(
    g: GgufFile, shapes: Mapping[tuple[int, str], tuple[int, int]]
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor in g.tensors.values():
        m = _KEY.fullmatch(tensor.name)
        hf = hf_tensor_name(m.group(1)) if m else None  # model.layers.N.self_attn.q_proj.weight
        parts = hf.split(".") if hf else []
        if m is None or len(parts) != 6 or parts[4] not in SUPPORTED_MODULES:
            raise AdapterError(
                f"{g.path}: tensor {tensor.name!r} is not a lora_a/lora_b weight of a decoder "
                f"layer's {'/'.join(SUPPORTED_MODULES)} projection"
            )
        layer, module = int(parts[2]), parts[4]
        if (layer, module) not in shapes:
            raise AdapterError(
                f"{g.path}: tensor {tensor.name!r}: the base model has no {module} in layer "
                f"{layer} that takes a LoRA delta"
            )
        found.setdefault((layer, module), {})[m.group(2)] = _values(tensor)
    for (layer, module), pair in found.items():
        if set(pair) != {"a", "b"}:
            raise AdapterError(
                f"{g.path}: layer {layer} {module}: lora_{'b' if 'a' in pair else 'a'} missing"
            )
    return {key: (pair["a"], pair["b"]) for key, pair in found.items()}


def _values(tensor: ReaderTensor) -> np.ndarray:
    values = dequantize(tensor.data, tensor.tensor_type)
    return values.reshape([int(d) for d in reversed(tensor.shape)]).astype(np.float32)


def _fingerprint(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.digest()[:16]
