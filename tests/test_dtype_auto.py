"""`--dtype auto`: bf16 where the CPU has AMX / AVX-512 BF16, fp32 elsewhere, overridable."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.model import device as engine_config
from shared.model.device import AUTO_DTYPE_ENV, auto_dtype, resolve_dtype
from shared.model.loader import default_dtype, load_model


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    auto_dtype.cache_clear()
    yield
    auto_dtype.cache_clear()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    return set(line.split(":", 1)[1].split())


def test_auto_follows_the_cpu_flags(no_override: None, caplog: pytest.LogCaptureFixture) -> None:
    fast = bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())
    with caplog.at_level(logging.INFO, logger=engine_config.__name__):
        got = resolve_dtype("auto", torch.device("cpu"))
    assert got == (torch.bfloat16 if fast else torch.float32)
    assert "dtype auto -> " in caplog.text  # logged at start-up
    assert default_dtype(torch.device("cpu")) == got
    assert load_model("tiny").model.dtype == got


def test_cpu_without_bf16_units_gets_fp32(
    no_override: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_config, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    auto_dtype.cache_clear()
    monkeypatch.setattr(engine_config, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_override_and_explicit_names(no_override: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    auto_dtype.cache_clear()
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=AUTO_DTYPE_ENV):
        resolve_dtype("auto", torch.device("cpu"))
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        EngineConfig(dtype="fp8").validate()


def test_suite_pins_fp32() -> None:
    # conftest.py pins auto to fp32 so parity tests compare fp32 with fp32 transformers
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
