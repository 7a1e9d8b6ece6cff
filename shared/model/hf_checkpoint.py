"""A local Hugging Face checkpoint directory's files, read for serving: `config.json`,
`generation_config.json` (eos ids and sampling defaults), the chat template, the tokenizer and
the safetensors weights (one file or a sharded index). Every problem is raised at load time with
the file and tensor named (shared/model/loader.py builds the model from these)."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.model.causal_lm import Model
from shared.model.chat_template import ChatTemplate
from shared.model.config import ModelConfig, eos_token_ids_or_none
from shared.model.registry import family_for
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer

log = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters write that the model recomputes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"missing {file.name} in {file.parent}")
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc


def eos_token_ids(path: Path, config: ModelConfig) -> frozenset[int]:
    generation = read_json(path / "generation_config.json", required=False)
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


def generation_defaults(path: Path) -> dict[str, Any]:
    generation = read_json(path / "generation_config.json", required=False)
    return {k: generation[k] for k in _GENERATION_DEFAULT_KEYS if generation.get(k) is not None}


def _special_token_text(value: object) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def chat_template(path: Path) -> ChatTemplate | None:
    """`chat_template.jinja` first, then `tokenizer_config.json`'s `chat_template` (a string or
    a list of named templates, of which transformers uses "default")."""
    tok_config = read_json(path / "tokenizer_config.json", required=False)
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


def load_tokenizer(path: Path, config: ModelConfig, eos: frozenset[int]) -> Tokenizer:
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
        weight_map = read_json(index, required=True).get("weight_map")
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


def load_weights(model: Model, path: Path) -> None:
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


def load_module_weights(module: torch.nn.Module, path: Path, prefix: str) -> None:
    """Fill `module`'s parameters from the checkpoint tensors named `prefix` + their names (an
    encoder node's vision tower: `visual.`), ignoring every other tensor."""
    files = _weight_files(path)
    params = dict(module.named_parameters())
    missing = sorted(prefix + n for n in params if prefix + n not in files)
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensor(s) {missing[:5]}")
    with torch.no_grad():
        for name, tensor, file in _iter_tensors([prefix + n for n in params], files):
            param = params[name.removeprefix(prefix)]
            if tensor.shape != param.shape:
                raise ValueError(
                    f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {tuple(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))


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
