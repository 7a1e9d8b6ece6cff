"""The vision tower's output per image, kept while prompts that hold the image are computed:
a prompt's chunks each take their share of an image's embeddings, and a repeated image (same
digest) is not encoded again. Bounded in bytes, least recently used out first; an entry that is
evicted is recomputed when asked for again (the tower is deterministic), so the bound never
fails a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from shared.engine.requests.multimodal import PromptImage

# A 1,280 x 1,280 image is 2,116 tokens: at hidden 3,584 in bf16, 15 MB of embeddings
DEFAULT_ENCODER_CACHE_BYTES = 256 * 1024 * 1024

Encode = Callable[[Sequence[PromptImage]], list[torch.Tensor]]


class EncoderCache:
    def __init__(self, encode: Encode, limit_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self._encode = encode
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes_used = 0
        self.encoded_images = 0  # tower runs, for tests and metrics

    def embeddings(self, images: Sequence[PromptImage]) -> list[torch.Tensor]:
        """Each image's [tokens, hidden] embeddings; the missing ones encoded in one call."""
        missing = {image.digest: image for image in images if image.digest not in self._entries}
        encoded = self._encode(list(missing.values())) if missing else []
        fresh = dict(zip(missing, encoded, strict=True))
        self.encoded_images += len(fresh)
        out = []
        for image in images:
            tensor = fresh.get(image.digest)
            if tensor is None:
                tensor = self._entries[image.digest]
                self._entries.move_to_end(image.digest)
            out.append(tensor)
        for digest, tensor in fresh.items():
            self._store(digest, tensor)
        return out

    def _store(self, digest: bytes, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.limit_bytes:
            return  # used by this step only
        while self.bytes_used + size > self.limit_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.numel() * old.element_size()
        self._entries[digest] = tensor
        self.bytes_used += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes_used = 0
