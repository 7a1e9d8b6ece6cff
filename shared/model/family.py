"""What a model family declares to be served: the Hugging Face `architectures` names and GGUF
`general.architecture` values it covers, how its config.json maps onto `ModelConfig` (and back,
for `pdserve export-hf`), and how its checkpoint's tensor names map onto the model's parameters.

Parameters carry the Hugging Face names of the unfused layout (`q_proj`, `k_proj`, `v_proj`,
`gate_proj`, `up_proj`); a family whose checkpoints stack several of them in one tensor (Phi-3's
`qkv_proj`, `gate_up_proj`) lists those as `FusedTensor`s, split row-wise at load time and
stacked again on export. A family whose checkpoints name a parameter otherwise (Mixtral's
`block_sparse_moe.experts.{e}.w1` for `mlp.experts.{e}.gate_proj`) lists `RenamedTensor`s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from shared.model.config import ModelConfig

ConfigFromHf = Callable[[Mapping[str, Any]], ModelConfig]
ConfigToHf = Callable[[ModelConfig], dict[str, Any]]
_LAYER = re.compile(r"(model\.layers\.\d+\.)(.+)")


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor `checkpoint` (a name inside `model.layers.N.`) holding the rows of
    the parameters `parts`, in that order."""

    checkpoint: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class RenamedTensor:
    """Parameters whose name inside `model.layers.N.` fully matches regex `pattern` are the
    checkpoint tensors `checkpoint` (a `re.Match.expand` template)."""

    pattern: str
    checkpoint: str


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    # GGUF `general.architecture` -> the Hugging Face architecture it loads as
    gguf_architectures: Mapping[str, str]
    config_from_hf: ConfigFromHf
    config_to_hf: ConfigToHf
    fused_tensors: tuple[FusedTensor, ...] = ()
    renamed_tensors: tuple[RenamedTensor, ...] = ()

    def checkpoint_layout(self, param_names: Collection[str]) -> dict[str, list[str]]:
        """Checkpoint tensor name -> the parameters it fills, in row order (one for most)."""
        part_of = {part: fused for fused in self.fused_tensors for part in fused.parts}
        layout: dict[str, list[str]] = {}
        for name in param_names:
            match = _LAYER.fullmatch(name)
            fused = part_of.get(match.group(2)) if match else None
            if match is None:
                layout[name] = [name]
                continue
            if fused is None:
                layout[match.group(1) + self._checkpoint_name(match.group(2))] = [name]
                continue
            layer = match.group(1)
            layout[layer + fused.checkpoint] = [layer + part for part in fused.parts]
        return layout

    def _checkpoint_name(self, local: str) -> str:
        for renamed in self.renamed_tensors:
            match = re.fullmatch(renamed.pattern, local)
            if match:
                return match.expand(renamed.checkpoint)
        return local
