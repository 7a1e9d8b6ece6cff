"""The LoRA adapters resident on one model: `max_loras` slots of device memory per projection,
and the per-step delta that lets requests of different adapters (and the base) share a batch.

Per fused projection (q/k/v, gate/up) and per plain one (o, down), every slot's A matrices are
stacked into one `[slots, parts * R, in]` tensor and each part's B matrices into one
`[slots, R, out_part]` tensor (R = `--max-lora-rank`, smaller ranks zero-padded, B already
scaled). A step groups the tokens that run an adapter by slot (shared/model/lora_batch.py) and
computes, for all of them at once,

    h[g] = x_g @ A[slot_g].T;  delta[g] = concat_p(h[g, :, part p] @ B_p[slot_g])

(batched GEMMs over the active slots: one for A, one per part for B, which keeps each part's B
free of the other parts' zeros: a step is bound by reading these weights)
then adds each token's row of its group's delta to its output: a token gets exactly its own
adapter's `s * B (A x)`, tokens of the base model are not touched, and the work is that of the
tokens' own rank whatever the mix of adapters, with no per-adapter loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.lora_adapter import LoraAdapter
from shared.model.lora_batch import LoraBatch

# site -> the Hugging Face projections it fuses, in the order of the model's fused output rows
SITES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class _Site:
    a: torch.Tensor  # [slots, parts * R, in]
    b: tuple[torch.Tensor, ...]  # per part: [slots, R, out_part]


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
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.adapters: dict[str, LoraAdapter] = {}

    def _allocate(self, layer: int, parts: tuple[str, ...]) -> _Site:
        width = self.shapes[(layer, parts[0])][1]
        z = dict(device=self.device, dtype=self.dtype)
        a = torch.zeros(self.max_loras, len(parts) * self.max_rank, width, **z)
        b = tuple(
            torch.zeros(self.max_loras, self.max_rank, self.shapes[(layer, p)][0], **z)
            for p in parts
        )
        return _Site(a, b)

    def bytes(self) -> int:
        return sum(s.a.nbytes + sum(b.nbytes for b in s.b) for s in self.sites.values())

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
        r_max = self.max_rank
        for (layer, site), tensors in self.sites.items():
            tensors.a[slot].zero_()
            for p, module in enumerate(SITES[site]):
                tensors.b[p][slot].zero_()
                lora = None if adapter is None else adapter.modules.get((layer, module))
                if lora is None:
                    continue
                r = lora.a.shape[0]
                tensors.a[slot, p * r_max : p * r_max + r].copy_(lora.a)
                tensors.b[p][slot, :r].copy_(lora.b.T)

    def step(self, batch: LoraBatch) -> LoraStep:
        """The deltas of one forward whose adapter tokens `batch` groups."""
        return LoraStep(self, batch, len(batch.active) == self.max_loras)


@dataclass
class LoraStep:
    bank: LoraBank
    batch: LoraBatch
    every_slot: bool  # every slot is active: the stacked weights are used as they are

    def add(self, layer: int, site: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the projection of x) plus each adapter token's own delta."""
        tensors = self.bank.sites.get((layer, site))
        if tensors is None:
            return out
        a, bs, lb = tensors.a, tensors.b, self.batch
        if not self.every_slot:
            a = a.index_select(0, lb.active_index)
            bs = tuple(b.index_select(0, lb.active_index) for b in bs)
        grouped = x.new_zeros(len(lb.active), lb.longest, x.shape[1])
        grouped[lb.group, lb.position] = x.index_select(0, lb.rows)
        h = torch.bmm(grouped, a.transpose(1, 2))
        r = self.bank.max_rank
        parts = [torch.bmm(h[:, :, p * r : (p + 1) * r], b) for p, b in enumerate(bs)]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out.index_add(0, lb.rows, delta[lb.group, lb.position])
