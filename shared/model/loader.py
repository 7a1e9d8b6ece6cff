"""Load a model for serving: the built-in `tiny` / `smollm2` models, a GGUF file (or a directory
holding exactly one), or a local Hugging Face checkpoint directory.

Never touches the network. A checkpoint directory needs `config.json` and `model.safetensors` (or a
sharded `model.safetensors.index.json`); `generation_config.json`'s `eos_token_id` overrides
config.json's. `tokenizer.json` is read with the `tokenizers` package; without one, a byte-level
tokenizer stands in when the vocabulary can hold the 256 bytes (so an exported test model still
serves), otherwise loading fails with an error naming the missing file.

A checkpoint directory's files are read by `shared.model.hf_checkpoint`; a GGUF file by
`shared.model.gguf_loader` / `gguf_tokenizer` (config, weights, tokenizer, chat template and
sampling defaults from its metadata). Every problem (missing file, not GGUF, truncated, unsupported
architecture or tensor type, missing / unexpected tensor, shape mismatch) is raised at load time
with the file and tensor named, never at the first request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.model import hf_checkpoint
from shared.model.causal_lm import Model
from shared.model.chat_template import ChatTemplate
from shared.model.config import ModelConfig
from shared.model.gguf_builtin import SMOLLM2_SPEC, smollm2_path
from shared.model.gguf_file import GgufError, open_gguf
from shared.model.gguf_loader import (
    gguf_eos_token_ids,
    gguf_generation_defaults,
    gguf_model_config,
    load_gguf_weights,
)
from shared.model.gguf_tokenizer import GgufTokenizerInfo, build_gguf_tokenizer
from shared.model.registry import build_model, config_from_hf
from shared.model.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from shared.model.vision.image_encoder import checkpoint_processor
from shared.model.vision.image_processor import ImageProcessorConfig

log = logging.getLogger(__name__)

TINY_SPEC = "tiny"
TINY_SEED = 1234
TINY_INIT_STD = 0.02


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
    # how a vision model's images are resized and cut into patches (preprocessor_config.json,
    # else the family's defaults); None for a text model
    image_processor: ImageProcessorConfig | None = None


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
    config = config_from_hf(hf_checkpoint.read_json(path / "config.json", required=True))
    eos = hf_checkpoint.eos_token_ids(path, config)
    return hf_checkpoint.load_tokenizer(path, config, eos), hf_checkpoint.chat_template(path)


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
    config_json = hf_checkpoint.read_json(path / "config.json", required=True)
    config = config_from_hf(config_json)
    eos = hf_checkpoint.eos_token_ids(path, config)
    model = build_model(config, device, dtype)
    hf_checkpoint.load_weights(model, path)
    tokenizer = hf_checkpoint.load_tokenizer(path, config, eos)
    return LoadedModel(
        model,
        config,
        tokenizer,
        path.name,
        eos,
        chat_template=hf_checkpoint.chat_template(path),
        generation_defaults=hf_checkpoint.generation_defaults(path),
        image_processor=_image_processor(path, config),
    )


def _image_processor(path: Path, config: ModelConfig) -> ImageProcessorConfig | None:
    return None if config.vision is None else checkpoint_processor(path, config.vision)
