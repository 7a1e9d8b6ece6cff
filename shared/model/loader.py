"""Load a model for serving: the built-in `tiny` / `smollm2` models, a GGUF file (or a directory
holding exactly one), or a local Hugging Face checkpoint directory.

Never touches the network. A checkpoint directory needs `config.json` and `model.safetensors` (or a
sharded `model.safetensors.index.json`); `generation_config.json`'s `eos_token_id` overrides
config.json's. `tokenizer.json` is read with the `tokenizers` package; without one, a byte-level
tokenizer stands in when the vocabulary can hold the 256 bytes (so an exported test model still
serves), otherwise loading fails with an error naming the missing file.

A GGUF file is read by `shared.model.gguf_loader` / `gguf_tokenizer` (config, weights, tokenizer,
chat template and sampling defaults from its metadata). Every problem (missing file, not GGUF,
truncated, unsupported architecture or tensor type, missing / unexpected tensor, shape mismatch)
is raised at load time with the file and tensor named, never at the first request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.model.causal_lm import Model
from shared.model.chat_template import ChatTemplate
from shared.model.config import ModelConfig, eos_token_ids_or_none
from shared.model.gguf_builtin import SMOLLM2_SPEC, smollm2_path
from shared.model.gguf_file import GgufError, open_gguf
from shared.model.gguf_loader import (
    gguf_eos_token_ids,
    gguf_generation_defaults,
    gguf_model_config,
    load_gguf_weights,
)
from shared.model.gguf_tokenizer import GgufTokenizerInfo, build_gguf_tokenizer
from shared.model.registry import build_model, config_from_hf, family_for
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

log = logging.getLogger(__name__)

TINY_SPEC = "tiny"
TINY_SEED = 1234
TINY_INIT_STD = 0.02
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters write that the model recomputes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: Model
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    eos_token_ids: frozenset[int]
    # the model's own chat template, None when it has none (chat requests are then refused)
    chat_template: ChatTemplate | None = None
    # sampling defaults from generation_config.json (temperature, top_p, top_k, ...), as vLLM
    # applies them to fields a request leaves out
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def tiny_config() -> ModelConfig:
    """A 4-layer byte-level Llama: vocab = 256 bytes + bos 256 + eos 257 + pad 258."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=259,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_ids=(257,),
        pad_token_id=258,
    )


def default_dtype(device: torch.device) -> torch.dtype:
    """`--dtype auto`: bf16 on CUDA and on CPUs with AMX / AVX-512 BF16, else fp32."""
    from shared.model.device import auto_dtype

    return auto_dtype(torch.device(device).type)


def load_model(
    spec: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> LoadedModel:
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if spec == TINY_SPEC:
        return _load_tiny(device, dtype)
    if spec == SMOLLM2_SPEC:
        return load_gguf(smollm2_path(), device, dtype, name=SMOLLM2_SPEC)
    gguf_file = gguf_file_for(Path(spec))
    if gguf_file is not None:
        return load_gguf(gguf_file, device, dtype)
    return _load_directory(Path(spec), device, dtype)


# ------------------------------------------------------------------------------------ gguf

GGUF_SUFFIX = ".gguf"


def gguf_file_for(path: Path) -> Path | None:
    """The GGUF file `path` names: itself when it is a file, the one `.gguf` in a directory
    without config.json, None for a Hugging Face directory (or a path that does not exist)."""
    if path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise GgufError(
            f"{path} holds {len(found)} GGUF files {[f.name for f in found]}; name one of them"
        )
    return found[0] if found else None


def load_gguf(
    path: Path, device: torch.device, dtype: torch.dtype, *, name: str | None = None
) -> LoadedModel:
    gguf = open_gguf(path)
    eos = gguf_eos_token_ids(gguf)
    config = gguf_model_config(gguf, eos_token_ids=eos)
    tok = build_gguf_tokenizer(gguf)
    if tok.tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise gguf.error(
            f"tokenizer has {tok.tokenizer.get_vocab_size(with_added_tokens=True)} tokens, the "
            f"model's vocabulary only {config.vocab_size}"
        )
    model = build_model(config, device, dtype)
    load_gguf_weights(model, gguf)
    template = _gguf_chat_template(gguf.get("tokenizer.chat_template"), tok)
    tokenizer = HfTokenizer(tok.tokenizer, bos_token_id=tok.bos_token_id, eos_token_ids=eos)
    return LoadedModel(
        model,
        config,
        tokenizer,
        name or path.stem,
        frozenset(eos),
        chat_template=template,
        generation_defaults=gguf_generation_defaults(gguf),
    )


def _gguf_chat_template(source: object, tok: GgufTokenizerInfo) -> ChatTemplate | None:
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, bos_token=tok.bos_token, eos_token=tok.eos_token)


def load_tokenizer_and_template(spec: str) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer and chat template of model `spec`, without building the model (a client
    such as `pdserve up --run` formats a chat prompt with them)."""
    if spec == TINY_SPEC:
        return ByteTokenizer(bos_token_id=256, eos_token_ids=(257,), pad_token_id=258), None
    gguf_path = smollm2_path() if spec == SMOLLM2_SPEC else gguf_file_for(Path(spec))
    if gguf_path is not None:
        gguf = open_gguf(gguf_path)
        tok = build_gguf_tokenizer(gguf)
        eos = gguf_eos_token_ids(gguf)
        tokenizer = HfTokenizer(tok.tokenizer, bos_token_id=tok.bos_token_id, eos_token_ids=eos)
        return tokenizer, _gguf_chat_template(gguf.get("tokenizer.chat_template"), tok)
    path = Path(spec)
    config = config_from_hf(_read_json(path / "config.json", required=True))
    return _load_tokenizer(path, config, _eos_token_ids(path, config)), _chat_template(path)


# ------------------------------------------------------------------------------------ tiny


def _load_tiny(device: torch.device, dtype: torch.dtype) -> LoadedModel:
    config = tiny_config()
    model = build_model(config, device, dtype)
    init_dummy_weights(model, TINY_SEED)
    tokenizer = ByteTokenizer(bos_token_id=256, eos_token_ids=(257,), pad_token_id=258)
    return LoadedModel(model, config, tokenizer, TINY_SPEC, frozenset(config.eos_token_ids))


def init_dummy_weights(model: Model, seed: int, std: float = TINY_INIT_STD) -> None:
    """Deterministic weights, identical on every machine, whatever the model's device or dtype.

    Matrices are drawn from N(0, std) like transformers' init, norms are ones, biases zeros. The
    draw happens on CPU in float64 from a seeded generator, in parameter-name order: float32's
    CPU normal sampler has a vectorised path whose rounding depends on the host's SIMD support,
    the float64 path does not, and rounding to the model dtype hides any last-bit libm noise.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape, dtype=torch.float64)
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape, dtype=torch.float64)
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float64) * std
            param.copy_(values.to(param.dtype))


# ------------------------------------------------------------------------------- directory


def _load_directory(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if not path.is_dir():
        raise FileNotFoundError(
            f"model spec {str(path)!r} is neither {TINY_SPEC!r}, {SMOLLM2_SPEC!r}, a GGUF file nor "
            "an existing directory"
        )
    config_json = _read_json(path / "config.json", required=True)
    config = config_from_hf(config_json)
    eos = _eos_token_ids(path, config)
    model = build_model(config, device, dtype)
    _load_weights(model, path)
    tokenizer = _load_tokenizer(path, config, eos)
    return LoadedModel(
        model,
        config,
        tokenizer,
        path.name,
        eos,
        chat_template=_chat_template(path),
        generation_defaults=_generation_defaults(path),
    )


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"missing {file.name} in {file.parent}")
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc


def _eos_token_ids(path: Path, config: ModelConfig) -> frozenset[int]:
    generation = _read_json(path / "generation_config.json", required=False)
    override = eos_token_ids_or_none(generation.get("eos_token_id"))
    eos = frozenset(override if override is not None else config.eos_token_ids)
    if not eos:
        log.warning("%s names no eos_token_id: generation stops only on length", path)
    for token in eos:
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"eos token id {token} outside vocab [0, {config.vocab_size})")
    return eos


# generation_config.json keys that are request defaults (vLLM's set of overridable fields)
_GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def _generation_defaults(path: Path) -> dict[str, Any]:
    generation = _read_json(path / "generation_config.json", required=False)
    return {k: generation[k] for k in _GENERATION_DEFAULT_KEYS if generation.get(k) is not None}


def _special_token_text(value: object) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def _chat_template(path: Path) -> ChatTemplate | None:
    """`chat_template.jinja` first, then `tokenizer_config.json`'s `chat_template` (a string or
    a list of named templates, of which transformers uses "default")."""
    tok_config = _read_json(path / "tokenizer_config.json", required=False)
    jinja_file = path / "chat_template.jinja"
    source: object = jinja_file.read_text() if jinja_file.is_file() else None
    if source is None:
        source = tok_config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(
        source,
        bos_token=_special_token_text(tok_config.get("bos_token")),
        eos_token=_special_token_text(tok_config.get("eos_token")),
    )


def _load_tokenizer(path: Path, config: ModelConfig, eos: frozenset[int]) -> Tokenizer:
    file = path / "tokenizer.json"
    if file.is_file():
        return HfTokenizer.from_file(file, bos_token_id=config.bos_token_id, eos_token_ids=eos)
    if config.vocab_size < 256:
        raise FileNotFoundError(
            f"missing tokenizer.json in {path}, and vocab_size {config.vocab_size} < 256 rules "
            "out the byte-level fallback"
        )
    log.warning("no tokenizer.json in %s: falling back to a byte-level tokenizer", path)
    return ByteTokenizer(
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos,
        pad_token_id=config.pad_token_id,
        vocab_size=config.vocab_size,
    )


# --------------------------------------------------------------------------------- weights


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map'")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"missing shard {file.name} (listed in {index})")
        return files
    single = path / _SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"missing {_SINGLE_FILE} (or {_INDEX_FILE}) in {path}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _load_weights(model: Model, path: Path) -> None:
    files = _weight_files(path)
    params = dict(model.named_parameters())
    layout = family_for(model.config.architecture).checkpoint_layout(params)
    _check_tensor_names(layout.keys(), files, path, model.config.tie_word_embeddings)
    with torch.no_grad():
        for name, tensor, file in _iter_tensors(layout.keys(), files):
            targets = [params[p] for p in layout[name]]
            expected = (sum(p.shape[0] for p in targets), *targets[0].shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {expected}"
                )
            # a fused checkpoint tensor (Phi-3's qkv_proj) fills its parts row by row
            rows = tensor.split([p.shape[0] for p in targets])
            for param, part in zip(targets, rows, strict=True):
                param.copy_(part.to(param.dtype))


def _check_tensor_names(
    wanted: Collection[str], files: dict[str, Path], path: Path, tied: bool
) -> None:
    wanted_set = set(wanted)
    missing = sorted(wanted_set - files.keys())
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks tensor(s) {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
        )
    benign = {"lm_head.weight"} if tied else set()
    unexpected = sorted(
        n
        for n in files.keys() - wanted_set
        if n not in benign and not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {path} has tensor(s) the config does not explain: {unexpected[:5]}"
            + (" ..." if len(unexpected) > 5 else "")
        )


def _iter_tensors(
    names: Collection[str], files: dict[str, Path]
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            for name in file_names:
                yield name, f.get_tensor(name), file
