"""Model loading: the built-in tiny model, checkpoint directories, config parsing, errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.kv.pool import allocate_kv_pool
from shared.model.forward_batch import ForwardBatch, SeqEntry
from shared.model.loader import load_model
from shared.model.registry import config_from_hf
from shared.model.tokenizer import ByteTokenizer, HfTokenizer
from tests.support.checkpoints import EOS_TOKEN, EOT_TOKEN, special_ids


def tiny_logits(ids: list[int]) -> torch.Tensor:
    loaded = load_model("tiny")
    pool = allocate_kv_pool(loaded.config.kv_layout(16, torch.float32), 8, "cpu")
    batch = ForwardBatch.build([SeqEntry(ids, 0, [3, 1, 4])], 16, "cpu")
    return loaded.model(batch, pool, all_logits=True)


@pytest.fixture
def llama_copy(checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of the llama checkpoint that a test may damage."""
    return Path(shutil.copytree(checkpoint("llama"), tmp_path / "llama"))


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------------------------ tiny


def test_tiny_is_deterministic_across_fresh_loads() -> None:
    ids = [256, *b"hello, world"]
    first, second = tiny_logits(ids), tiny_logits(ids)
    assert torch.equal(first, second)
    a, b = load_model("tiny").model.state_dict(), load_model("tiny").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_weights_are_pinned() -> None:
    # Prefill and decode nodes on different machines must build identical weights; these values
    # pin the generator so a change to the init recipe cannot go unnoticed.
    weights = load_model("tiny").model.state_dict()
    embed = weights["model.embed_tokens.weight"]
    assert embed.shape == (259, 128)
    assert abs(float(embed.double().std()) - 0.02) < 0.001
    torch.testing.assert_close(
        embed[0, :3], torch.tensor([-0.02366443, 0.03737014, 0.00818771]), atol=1e-6, rtol=0
    )
    assert torch.equal(weights["model.norm.weight"], torch.ones(128))


def test_tiny_shape_and_tokenizer() -> None:
    loaded = load_model("tiny")
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        259,
        128,
        4,
        4,
        2,
    )
    assert loaded.name == "tiny"
    assert loaded.eos_token_ids == frozenset({257})
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.tokenizer.encode("hi") == [256, 104, 105]
    assert loaded.model.lm_head is not None  # untied


def test_tiny_on_bf16_has_the_rounded_fp32_weights() -> None:
    fp32 = load_model("tiny").model.state_dict()
    bf16 = load_model("tiny", dtype=torch.bfloat16).model.state_dict()
    for name, tensor in fp32.items():
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


# ------------------------------------------------------------------------------ directories


def test_checkpoint_directory_loads_with_generation_config_eos(
    checkpoint: Callable[..., Path],
) -> None:
    path = checkpoint("llama")
    loaded = load_model(str(path))
    ids = special_ids()
    # config.json names only </s>; generation_config.json's list wins.
    assert loaded.config.eos_token_ids == (ids[EOS_TOKEN],)
    assert loaded.eos_token_ids == frozenset({ids[EOS_TOKEN], ids[EOT_TOKEN]})
    assert isinstance(loaded.tokenizer, HfTokenizer)
    assert loaded.tokenizer.eos_token_ids == loaded.eos_token_ids
    assert loaded.name == path.name
    assert loaded.config.architecture == "LlamaForCausalLM"


def test_tied_checkpoint_has_no_separate_lm_head(checkpoint: Callable[..., Path]) -> None:
    loaded = load_model(str(checkpoint("qwen2")))
    assert loaded.config.tie_word_embeddings
    assert loaded.config.attention_bias and not loaded.config.attention_out_bias
    assert loaded.model.lm_head is None


def test_unsupported_architecture_is_named(llama_copy: Path) -> None:
    edit_json(llama_copy / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(str(llama_copy))
    assert "LlamaForCausalLM" in str(err.value)  # the supported ones are listed


def test_missing_safetensors_is_named(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(str(llama_copy))


def test_missing_config_is_named(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(str(llama_copy))


def test_missing_tensor_is_named(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(llama_copy))


def test_unexpected_tensor_is_named(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(str(llama_copy))


def test_shape_mismatch_names_tensor_and_file(llama_copy: Path) -> None:
    edit_json(llama_copy / "config.json", intermediate_size=96)
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*model\.safetensors.*\(96, 64\)"):
        load_model(str(llama_copy))


def test_sharded_checkpoint_loads_and_missing_shard_is_named(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = checkpoint("llama", max_shard_size="40KB", num_hidden_layers=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert load_model(str(path)).config.num_layers == 3

    damaged = Path(shutil.copytree(path, tmp_path / "sharded"))
    (damaged / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_model(str(damaged))


def test_without_tokenizer_json_falls_back_to_bytes(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.json").unlink()
    loaded = load_model(str(llama_copy))
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("é")) == "é"


def test_without_tokenizer_json_and_small_vocab_fails(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.json").unlink()
    for name in ("config.json", "generation_config.json"):
        edit_json(llama_copy / name, eos_token_id=2, bos_token_id=1)
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[key] = tensors[key][:200].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    edit_json(llama_copy / "config.json", vocab_size=200)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_model(str(llama_copy))


def test_nonexistent_spec() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model("/definitely/no-such-model")


# --------------------------------------------------------------------------- config parsing

_LLAMA3_4X = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "tie_word_embeddings": True,
}


def test_config_accepts_transformers_4_and_5_rope_spellings() -> None:
    v4 = config_from_hf(_LLAMA3_4X)
    v5_dict = {k: v for k, v in _LLAMA3_4X.items() if k not in ("rope_theta", "rope_scaling")}
    v5_dict["rope_parameters"] = {**_LLAMA3_4X["rope_scaling"], "rope_theta": 500000.0}
    v5 = config_from_hf(v5_dict)
    assert v4 == v5
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling.rope_type == "llama3"
    assert v4.rope_scaling.original_max_position_embeddings == 8192
    assert v4.eos_token_ids == (2, 3)
    assert v4.head_dim == 16
    # Older configs spell the type key `type`.
    old = {**_LLAMA3_4X, "rope_scaling": {**_LLAMA3_4X["rope_scaling"], "type": "llama3"}}
    del old["rope_scaling"]["rope_type"]
    assert config_from_hf(old) == v4


def test_config_defaults_and_rejections() -> None:
    plain = {k: v for k, v in _LLAMA3_4X.items() if k not in ("rope_theta", "rope_scaling")}
    config = config_from_hf(plain)
    assert config.rope_theta == 10000.0
    assert config.rope_scaling.rope_type == "default"
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf({**plain, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="gelu"):
        config_from_hf({**plain, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        config_from_hf({**plain, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in plain.items() if k != "num_hidden_layers"})


def test_sliding_window_layers_follow_transformers() -> None:
    base = {**_LLAMA3_4X, "num_hidden_layers": 4, "sliding_window": 64}
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_window == 64 and mistral.sliding_window_layers == (0, 1, 2, 3)
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"]}
    assert config_from_hf(qwen).sliding_window is None  # use_sliding_window off
    windowed = config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2})
    assert windowed.sliding_window_layers == (2, 3)
    assert windowed.window_for_layer(1) is None and windowed.window_for_layer(2) == 64
    llama = config_from_hf(base)
    assert llama.sliding_window is None


def test_kv_layout_matches_config() -> None:
    config = load_model("tiny").config
    layout = config.kv_layout(16, torch.bfloat16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (4, 2, 32)
    assert layout.dtype == "bfloat16" and layout.block_size == 16
    assert config.kv_layout(16, "float32").dtype == "float32"
