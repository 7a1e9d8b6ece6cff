"""The C kernels built ahead for CPU variants (`pdserve build-kernels`) and chosen at load by what
the CPU runs (shared/model/native.py): real compiles, real ctypes loads, a real kernel call
against torch's formulas, and each state /version reports."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from shared.model import fused_ops, kernel_build, native
from shared.model.kernel_catalog import KERNELS, VARIANTS, Variant, variants
from shared.model.llama import apply_rotary, write_kv
from tests.test_fused_ops import _rope

CC = shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here: nothing can be built")
x86_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the x86-64 variants are built and loaded here"
)
X86 = {v.name: v for v in VARIANTS["x86_64"]}
BASELINE, V3, V4 = X86["x86-64"], X86["x86-64-v3"], X86["x86-64-v4"]
BF16 = torch.bfloat16


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(prebuilt dir, per-user cache), both empty; the loader searches only them. The kernel
    wrappers' cached libraries are dropped before and after."""
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(prebuilt))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.delenv(native.CPU_FLAGS_ENV, raising=False)
    fused_ops.library.cache_clear()
    yield prebuilt, cache
    fused_ops.library.cache_clear()


def _no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")


def _tell_cpu(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str]) -> None:
    monkeypatch.setenv(native.CPU_FLAGS_ENV, ",".join(sorted(flags)) or " ")


def _rope_store_matches_torch() -> None:
    """One fused RoPE + KV store call, bit for bit against the model's torch formulas."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    rope = _rope(torch.randint(0, 5000, (tokens,), generator=gen), head_dim)
    pool = torch.randn(2, 8, 16, kv_heads, head_dim, generator=gen).to(BF16)
    slots = torch.randperm(128, generator=gen)[:tokens]
    theirs = pool.clone()
    split = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    expected = apply_rotary(split[:, : heads + kv_heads], *rope)
    write_kv(theirs, slots, expected[:, heads:], split[:, heads + kv_heads :])
    assert torch.equal(fused_ops.rope_store(qkv, heads, rope, pool, slots), expected)
    assert torch.equal(pool, theirs)


def test_variants_say_what_they_require_and_never_build_for_the_host() -> None:
    for arch in VARIANTS.values():
        for lesser, better in pairwise(arch):
            assert lesser.requires < better.requires  # worst first, each a strict step up
        for v in arch:
            assert not any("native" in flag for flag in v.flags), v
    assert set(KERNELS) == {p.stem for p in kernel_build.SOURCES.glob("*.c")}


@needs_cc
@x86_only
def test_build_kernels_then_the_loader_takes_the_variant_the_cpu_runs(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prebuilt, cache = dirs
    cmd = [sys.executable, "-m", "pdserve.cli", "build-kernels", "--out", str(prebuilt)]
    done = subprocess.run(
        [*cmd, "--variants", "x86-64"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in KERNELS:  # one line per library: what was built, where
        path = prebuilt / kernel_build.library_name(name, BASELINE)
        assert f"built {name} for x86-64 (any x86-64 CPU (SSE2)): {path}" in lines
        assert path.is_file()
    assert lines[-1] == f"{len(KERNELS)} of {len(KERNELS)} kernel libraries in {prebuilt}"
    assert CC is not None
    v3_path, built = kernel_build.build("fused_ops", V3, prebuilt, CC)
    assert built and kernel_build.build("fused_ops", V3, prebuilt, CC) == (v3_path, False)
    _no_compiler(monkeypatch)  # only what was built ahead: nothing is built at load

    # a CPU with only the x86-64 baseline gets the baseline build, for real
    _tell_cpu(monkeypatch, frozenset({"fpu", "sse", "sse2"}))
    lib = fused_ops.library()
    assert lib is not None and lib._name == str(
        prebuilt / kernel_build.library_name("fused_ops", BASELINE)
    )
    _rope_store_matches_torch()
    assert native.states()["fused_ops"].variant == "x86-64"

    if not V3.runs_on(native.cpu_flags()):
        pytest.skip("this CPU has no AVX2 + FMA: the x86-64-v3 build cannot run here")
    monkeypatch.delenv(native.CPU_FLAGS_ENV)  # this CPU's own flags
    fused_ops.library.cache_clear()
    lib = fused_ops.library()
    assert lib is not None and lib._name == str(v3_path)
    _rope_store_matches_torch()
    assert native.states()["fused_ops"].as_dict() == {
        "state": "on",
        "variant": "x86-64-v3",
        "path": str(v3_path),
    }
    assert not cache.exists()


@needs_cc
@x86_only
def test_a_first_start_builds_the_cpus_best_variant_with_a_warning(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, cache = dirs
    _tell_cpu(monkeypatch, V3.requires)  # the same choice on any CPU that runs this test
    with caplog.at_level(logging.WARNING, logger="shared.model.native"):
        state = native.resolve("fused_ops")
    assert state.on and state.variant == "x86-64-v3"
    assert state.path == str(cache / kernel_build.library_name("fused_ops", V3))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "built fused_ops for x86-64-v3 (AVX2 + FMA) in" in record.getMessage()
    assert "pdserve build-kernels" in record.getMessage()
    caplog.clear()
    assert native.resolve("fused_ops") == state and not caplog.records  # found: built once


def test_each_off_state_says_why(dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_compiler(monkeypatch)
    missing = native.resolve("fused_ops")
    assert not missing.on and missing.act
    assert "no C compiler to build one: run `pdserve build-kernels`" in missing.detail
    assert fused_ops.library() is None  # the caller keeps its torch path

    monkeypatch.setenv("PDSERVE_FUSED_OPS", "0")
    assert native.resolve("fused_ops") == native.KernelState(
        "fused_ops", False, detail="disabled by PDSERVE_FUSED_OPS=0"
    )
    avx2 = frozenset({"avx", "avx2", "fma"})
    assert native.resolve("skinny_gemm", avx2).as_dict() == {
        "state": "off",
        "reason": "CPU lacks avx512f",
    }
    assert set(native.states()) == set(KERNELS)


@needs_cc
@x86_only
def test_a_lesser_build_leaves_paths_off_and_says_so(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolution only (nothing loads): these builds need AVX-512 to run."""
    prebuilt, _ = dirs
    assert CC is not None
    v3_lib, _ = kernel_build.build("skinny_gemm", V3, prebuilt, CC)
    _no_compiler(monkeypatch)
    avx512 = V4.requires
    state = native.resolve("skinny_gemm", avx512)
    assert not state.on and state.act  # found the v3 stub: no path this CPU could run
    assert state.detail == (
        "the x86-64-v3 build has no path for this CPU: run `pdserve build-kernels`"
    )
    v4_lib, _ = kernel_build.build("skinny_gemm", V4, prebuilt, CC)
    state = native.resolve("skinny_gemm", avx512)
    assert (state.on, state.variant, state.path) == (True, "x86-64-v4", str(v4_lib))
    assert state.detail == "bf16 path off: CPU lacks avx512_bf16"
    assert v3_lib != v4_lib


def test_variants_of_an_unknown_architecture_are_the_compilers_default() -> None:
    (generic,) = variants("riscv64")
    assert generic == Variant("generic", (), frozenset(), "the compiler's default target")
