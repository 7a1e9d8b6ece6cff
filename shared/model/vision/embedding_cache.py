"""A vision tower's output per image, kept by image content (its digest) so that a prompt's
chunks each take their share of an image's embeddings and a repeated image is not encoded again:
the engine keeps torch tensors here, an encoder node numpy arrays. Bounded in bytes, least
recently used out first; an entry that is evicted is recomputed when asked for again (the tower
is deterministic), so the bound never fails a request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class Keyed(Protocol):
    @property
    def digest(self) -> bytes: ...


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


ImageT = TypeVar("ImageT", bound=Keyed)
EmbeddingsT = TypeVar("EmbeddingsT", bound=Sized)

# A 1,280 x 1,280 image is 2,116 tokens: at hidden 3,584 in bf16, 15 MB of embeddings
DEFAULT_EMBEDDING_CACHE_BYTES = 256 * 1024 * 1024


class EmbeddingCache(Generic[ImageT, EmbeddingsT]):
    def __init__(
        self,
        encode: Callable[[Sequence[ImageT]], list[EmbeddingsT]],
        limit_bytes: int = DEFAULT_EMBEDDING_CACHE_BYTES,
    ) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self._encode = encode
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[bytes, EmbeddingsT] = OrderedDict()
        self.bytes_used = 0
        self.encoded_images = 0  # tower runs, for tests and metrics

    def embeddings(self, images: Sequence[ImageT]) -> list[EmbeddingsT]:
        """Each image's embeddings; the missing ones encoded in one call."""
        missing = {image.digest: image for image in images if image.digest not in self._entries}
        encoded = self._encode(list(missing.values())) if missing else []
        fresh = dict(zip(missing, encoded, strict=True))
        self.encoded_images += len(fresh)
        out = []
        for image in images:
            value = fresh.get(image.digest)
            if value is None:
                value = self._entries[image.digest]
                self._entries.move_to_end(image.digest)
            out.append(value)
        for digest, value in fresh.items():
            self._store(digest, value)
        return out

    def _store(self, digest: bytes, value: EmbeddingsT) -> None:
        if value.nbytes > self.limit_bytes:
            return  # used by this call only
        while self.bytes_used + value.nbytes > self.limit_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= old.nbytes
        self._entries[digest] = value
        self.bytes_used += value.nbytes
