"""The LoRA adapters resident on one model: `max_loras` slots of device memory per projection,
and the per-step delta that lets requests of different adapters (and the base) share a batch.

Per fused projection (q/k/v, gate/up) and per plain one (o, down), every slot's A matrices are
stacked into one `[parts * slots * R, in]` tensor and its B matrices into one
`[out, parts * slots * R]` tensor (R = `--max-lora-rank`, smaller ranks zero-padded, B already
scaled). A step computes, for the whole batch at once,

    out += ((x @ A_all.T) * mask) @ B_all.T

where `mask[t, c]` is 1 when column c belongs to token t's slot: each token gets exactly its own
adapter's `s * B (A x)` (masked columns contribute exact zeros; a base token gets + 0) in two
GEMMs per projection, whatever the mix, with no host sync and no per-adapter loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.model.lora_adapter import ATTENTION_MODULES, LoraAdapter, read_adapter
from shared.model.mlp import GatedMLP
from shared.model.self_attention import Attention

# site -> the Hugging Face projections it fuses, in the order of the model's fused output rows
SITES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class _Site:
    a: torch.Tensor  # [parts * slots * R, in]
    b: torch.Tensor  # [out, parts * slots * R]
    rows: tuple[tuple[int, int], ...]  # each part's (start, end) rows of the fused output


class LoraBank:
    """Device tensors for `max_loras` adapters of rank <= `max_rank` over a model's projections.

    `shapes`: (layer, module) -> (out_features, in_features) of every projection that takes a
    delta (a layer's attention and dense MLP; latent attention and experts take none)."""

    def __init__(
        self,
        shapes: dict[tuple[int, str], tuple[int, int]],
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"--max-loras {max_loras} and --max-lora-rank {max_rank} must be >= 1")
        self.shapes, self.max_loras, self.max_rank = shapes, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.sites: dict[tuple[int, str], _Site] = {}
        for layer in sorted({layer for layer, _ in shapes}):
            for site, parts in SITES.items():
                if all((layer, p) in shapes for p in parts):
                    self.sites[(layer, site)] = self._allocate(layer, parts)
        # column c of a one-part site belongs to slot c // R
        self._col_slot = torch.arange(max_loras * max_rank, device=device) // max_rank
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.adapters: dict[str, LoraAdapter] = {}

    def _allocate(self, layer: int, parts: tuple[str, ...]) -> _Site:
        outs = [self.shapes[(layer, p)][0] for p in parts]
        width = self.shapes[(layer, parts[0])][1]
        cols = len(parts) * self.max_loras * self.max_rank
        rows, start = [], 0
        for out in outs:
            rows.append((start, start + out))
            start += out
        z = dict(device=self.device, dtype=self.dtype)
        return _Site(torch.zeros(cols, width, **z), torch.zeros(start, cols, **z), tuple(rows))

    def bytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for s in self.sites.values())

    def load(self, adapter: LoraAdapter) -> int:
        """Copy `adapter` into a free slot; returns the slot."""
        if adapter.name in self.slots:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if not free:
            raise ValueError(
                f"cannot load LoRA adapter {adapter.name!r}: all --max-loras {self.max_loras} "
                "slots are taken (unload one or start with a larger --max-loras)"
            )
        slot = free[0]
        self._write(slot, adapter)
        self.slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot

    def unload(self, name: str) -> None:
        slot = self.slots.pop(name)
        del self.adapters[name]
        self._write(slot, None)

    def _write(self, slot: int, adapter: LoraAdapter | None) -> None:
        r_max, n = self.max_rank, self.max_loras
        for (layer, site), tensors in self.sites.items():
            for p, module in enumerate(SITES[site]):
                cols = slice((p * n + slot) * r_max, (p * n + slot + 1) * r_max)
                start, end = tensors.rows[p]
                tensors.a[cols].zero_()
                tensors.b[start:end, cols].zero_()
                lora = None if adapter is None else adapter.modules.get((layer, module))
                if lora is None:
                    continue
                r = lora.a.shape[0]
                first = cols.start
                tensors.a[first : first + r].copy_(lora.a)
                tensors.b[start:end, first : first + r].copy_(lora.b)

    def step(self, token_slots: torch.Tensor) -> LoraStep:
        """The delta for one forward: `token_slots[t]` is token t's slot, -1 for the base."""
        mask = (self._col_slot[None, :] == token_slots[:, None]).to(self.dtype)
        return LoraStep(self, mask)


@dataclass
class LoraStep:
    bank: LoraBank
    mask: torch.Tensor  # [T, slots * R]
    _tiled: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, layer: int, site: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the projection of x) plus each token's own adapter delta."""
        tensors = self.bank.sites.get((layer, site))
        if tensors is None:
            return out
        parts = len(SITES[site])
        mask = self._tiled.get(parts)
        if mask is None:
            mask = self._tiled[parts] = self.mask.repeat(1, parts)
        shrunk = (x @ tensors.a.T).mul_(mask)
        return torch.addmm(out, shrunk, tensors.b.T)


def lora_shapes(model: torch.nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (out, in) of every projection of `model` that takes a LoRA delta."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.self_attn, Attention):
            for name in ATTENTION_MODULES:
                shapes[(i, name)] = tuple(getattr(layer.self_attn, name).weight.shape)
        if isinstance(layer.mlp, GatedMLP):
            for name in SITES["gate_up"] + SITES["down"]:
                shapes[(i, name)] = tuple(getattr(layer.mlp, name).weight.shape)
    return shapes


def install_lora(
    model: torch.nn.Module, modules: dict[str, str], max_loras: int, max_rank: int
) -> LoraBank:
    """Give `model` a bank of `max_loras` slots and load each `--lora-modules` NAME=PATH."""
    if len(modules) > max_loras:
        raise ValueError(f"{len(modules)} --lora-modules but --max-loras is {max_loras}")
    shapes = lora_shapes(model)
    bank = LoraBank(shapes, max_loras, max_rank, model.device, model.dtype)
    for name, path in modules.items():
        bank.load(read_adapter(name, path, shapes, max_rank))
    model.lora = bank
    return bank


def token_slots(
    seq_slots: list[int], query_lens: list[int], device: torch.device
) -> torch.Tensor | None:
    """A batch's per-token slots from its sequences' (-1: base); None when all are the base, so
    a batch without adapters runs the model's unchanged path."""
    if all(s < 0 for s in seq_slots):
        return None
    per_seq = torch.tensor(seq_slots, dtype=torch.long)
    return per_seq.repeat_interleave(torch.tensor(query_lens)).to(device)
