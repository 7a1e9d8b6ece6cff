from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

# UCX must be configured before ucxx is imported anywhere in the test process
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# `--dtype auto` is bf16 on CPUs with AMX / AVX-512 BF16; parity tests compare against fp32
# transformers, so every engine the suite builds (and every node process it starts, which
# inherits this) resolves auto to float32. tests/test_dtype_auto.py covers the detection itself.
os.environ["PDSERVE_AUTO_DTYPE"] = "float32"


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path) -> Callable[..., Path]:
    """checkpoint("llama" | "llama3" | "qwen2" | "mistral", **overrides) -> a built HF dir."""
    from tests.checkpoints import cached_checkpoint

    def build(arch: str, **kwargs: object) -> Path:
        return cached_checkpoint(checkpoint_root, arch, **kwargs)

    return build
