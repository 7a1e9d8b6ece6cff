"""A GGUF file opened with llama.cpp's own reader (`gguf.GGUFReader`), with start-up errors.

`open_gguf(path)` memory-maps the file and checks it before anything is built from it: the magic,
that the header and tensor index parse, and that every tensor's data lies inside the file (a
download cut short fails here, not at the first request). Every error is a `GgufError` naming the
file and the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

GGUF_MAGIC = b"GGUF"


class _PlainArrayReader(GGUFReader):
    """`GGUFReader` over a plain ndarray view of its memory map.

    The reader slices `self.data` once per metadata value (~100k for a 49k-token vocabulary),
    and every slice of an `np.memmap` runs memmap's Python-level `__array_finalize__`: reading
    SmolLM2's header takes ~3x longer that way. The view shares the mapping (it stays alive as
    the view's base), so tensor data is still read lazily from the page cache.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


class GgufError(ValueError):
    """The file cannot be served: not GGUF, truncated, or describing something unsupported."""


class GgufFile:
    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self.reader = reader
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    def error(self, problem: str) -> GgufError:
        return GgufError(f"GGUF file {self.path}: {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool or list), or `default`."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise self.error(f"metadata lacks required key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


def open_gguf(path: str | Path) -> GgufFile:
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GgufError(f"GGUF file {path}: cannot be read: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise GgufError(
            f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}"
        )
    try:
        reader = _PlainArrayReader(path, "r")
    except Exception as exc:  # the reader raises ValueError / IndexError / TypeError from numpy
        raise GgufError(
            f"GGUF file {path} is truncated or corrupt: its header does not parse ({exc})"
        ) from exc
    gguf = GgufFile(path, reader)
    _check_tensor_extents(gguf)
    return gguf


def _check_tensor_extents(gguf: GgufFile) -> None:
    size = gguf.path.stat().st_size
    for tensor in gguf.reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise gguf.error(
                f"truncated: tensor {tensor.name!r} needs bytes up to {end}, the file has {size}"
            )
