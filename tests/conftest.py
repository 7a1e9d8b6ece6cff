from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.clusters import SHARED, SHARED_CLUSTERS, shared
from tests.support.shared_cluster import SharedCluster

if TYPE_CHECKING:
    from tests.up_process import Up

# UCX must be configured before ucxx is imported anywhere in the test process
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# One intra-op thread per process (the test process and every node it starts inherit it): the
# suite runs several torch processes at once on 2 cores, and their thread pools spinning against
# each other made each op ~30x slower. Tests check behaviour, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
    from tests.support.checkpoints import cached_checkpoint

    def build(arch: str, **kwargs: object) -> Path:
        return cached_checkpoint(checkpoint_root, arch, **kwargs)

    return build


@pytest.fixture(scope="module")
def variant(
    checkpoint: Callable[..., Path], request: pytest.FixtureRequest
) -> Callable[[str], Path]:
    """variant(name) -> the checkpoint the test module's VARIANTS table names: name -> (arch,
    overrides), as the model and family tests lay theirs out."""
    table = request.module.VARIANTS

    def get(name: str) -> Path:
        arch, kwargs = table[name]
        return checkpoint(arch, **kwargs)

    return get


def pytest_collection_finish(session: pytest.Session) -> None:
    """How many of the tests to run use each shared cluster: the last one stops it."""
    for name in SHARED_CLUSTERS:
        SHARED.expect(name, sum(name in item.fixturenames for item in session.items))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After the test's own fixtures: its shared clusters conserved, the last user's stopped."""
    for name in SHARED_CLUSTERS:
        if name in item.fixturenames:
            SHARED.release(name)


def pytest_sessionfinish() -> None:
    SHARED.close_all()  # one a test stopped midway (interrupted, -x) left running


@pytest.fixture
def smollm2_pd() -> SharedCluster:
    """tests/support/clusters.py's SmolLM2 P/D cluster, shared with the other tests using it."""
    cluster = shared("smollm2_pd")
    assert isinstance(cluster, SharedCluster)
    return cluster


@pytest.fixture
def smollm2_colocated() -> SharedCluster:
    """tests/support/clusters.py's colocated SmolLM2 node, shared likewise."""
    cluster = shared("smollm2_colocated")
    assert isinstance(cluster, SharedCluster)
    return cluster


@pytest.fixture
def smollm2_up2() -> Up:
    """tests/support/clusters.py's `pdserve up --model smollm2 --decode 2`, shared likewise."""
    from tests.support.shared_up import SharedUp

    cluster = shared("smollm2_up2")
    assert isinstance(cluster, SharedUp)
    return cluster.up
