"""LoRA adapters in llama.cpp's GGUF form (shared/model/lora_gguf.py): a PEFT adapter converted
as llama.cpp's convert_lora_to_gguf.py does (tensors renamed, llama's Q/K lora_B rows permuted as
the base weights are, alpha in the header) serves the same greedy tokens as peft's LoRA forward;
a file that is no LoRA adapter, or one for another base model, is refused naming the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.model.lora_adapter import AdapterError
from shared.model.lora_gguf import read_gguf_adapter
from shared.model.lora_install import lora_shapes
from tests.test_lora_engine import MAX_TOKENS, _engine, setup  # noqa: F401  (the fixture)

PARTS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rope halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_gguf(peft_dir: Path, out: Path, heads: tuple[int, int], kind: str = "adapter") -> Path:
    alpha = json.loads((peft_dir / "adapter_config.json").read_text())["lora_alpha"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_string("general.type", kind)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for key, value in load_file(peft_dir / "adapter_model.safetensors").items():
        m = PEFT_KEY.fullmatch(key)
        assert m is not None, key
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if which == "B" and module in ("q_proj", "k_proj"):
            value = llama_permute(value, heads[0] if module == "q_proj" else heads[1])
        name = f"blk.{layer}.{PARTS[module]}.weight.lora_{which.lower()}"
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def heads_of(base: Path) -> tuple[int, int]:
    config = json.loads((base / "config.json").read_text())
    return config["num_attention_heads"], config["num_key_value_heads"]


def test_gguf_adapters_serve_what_peft_computes(setup, tmp_path: Path) -> None:  # noqa: F811
    base, paths, prompts, want = setup
    names = ("all-r4", "mlp-r2")  # llama.cpp has no rsLoRA scale
    files = {n: str(to_gguf(Path(paths[n]), tmp_path / f"{n}.gguf", heads_of(base))) for n in names}
    engine = _engine(base, files)
    for name in names:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter=name)
        assert [o.token_ids for o in engine.generate(prompts, greedy)] == want[name], name
        engine.check_conservation()


def test_a_file_that_does_not_fit_is_refused_naming_why(setup, tmp_path: Path) -> None:  # noqa: F811
    base, paths, _, _ = setup
    heads = heads_of(base)
    shapes = lora_shapes(load_model(str(base)).model)
    model = to_gguf(Path(paths["all-r4"]), tmp_path / "model.gguf", heads, kind="model")
    with pytest.raises(AdapterError, match=r"general.type 'model'.*not a LoRA adapter"):
        read_gguf_adapter("x", model, shapes, 8, heads)
    narrow = {key: (out, inp // 2) for key, (out, inp) in shapes.items()}  # another base model
    fits = to_gguf(Path(paths["all-r4"]), tmp_path / "a.gguf", heads)
    with pytest.raises(AdapterError, match=r"lora_A shape .* does not fit the base model"):
        read_gguf_adapter("x", fits, narrow, 8, heads)
    with pytest.raises(AdapterError, match="exceeds --max-lora-rank 2"):
        read_gguf_adapter("x", fits, shapes, 2, heads)
