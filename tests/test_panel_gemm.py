"""kernels/panel_gemm.c: bf16 and fp32 GEMMs on a panel-packed weight (AVX-512 CPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import panel_gemm
from shared.model.gemm import PackedGemm

DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(
            not panel_gemm._kernel_works(dtype), reason=f"no {dtype} panel kernel on this CPU"
        ),
    )
    for dtype in (torch.float32, torch.bfloat16)
]
# fp32: sums of fp32 products in another order than float64's; bf16: exact products summed in
# fp32 and rounded once, so within a bf16 step of the exact value
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.bfloat16: {"rtol": 2**-8, "atol": 1e-3},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (37, 100), (960, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_gemm_is_the_product(
    dtype: torch.dtype, out_features: int, in_features: int, rows: int, threads: int
) -> None:
    """Any row count (tiles of 8 and every tail), out_features not a multiple of the panel
    width (the padded outputs are never written), with and without bias, 1 and 2 threads."""
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    packed = panel_gemm.pack(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (bias, None):
            out = panel_gemm.linear(x, packed, b, out_features)
            assert out.shape == (rows, out_features) and out.dtype == dtype
            want = F.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(dtype: torch.dtype) -> None:
    """Each output is one sum over k in order: the batch (size, position) never changes it, and
    a strided x (a view of a wider tensor) reads the same rows."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(100, 64, generator=gen).to(dtype)
    wide = torch.randn(300, 80, generator=gen).to(dtype)
    x = wide[:, 5:69]
    packed = panel_gemm.pack(weight)
    batched = panel_gemm.linear(x, packed, None, 100)
    for i in (0, 7, 8, 23, 257, 299):
        assert torch.equal(panel_gemm.linear(x[i : i + 1], packed, None, 100), batched[i : i + 1])
        assert torch.equal(panel_gemm.linear(x[i:], packed, None, 100)[0], batched[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_gemm_takes_the_panel_path_and_sees_weight_updates(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(panel_gemm, "chosen", lambda dtype: True)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    x = torch.randn(16, 64, generator=gen).to(dtype)
    gemm = PackedGemm(weight, None)
    with torch.inference_mode():
        first = gemm(x)
    assert gemm._kind == "panel"
    weight.mul_(-1)  # a checkpoint loaded after the first forward: the packed copy is rebuilt
    with torch.inference_mode():
        assert torch.equal(gemm(x), -first)


def test_bf16_with_odd_in_features_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(panel_gemm, "chosen", lambda dtype: True)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 63, generator=gen).bfloat16()
    odd = PackedGemm(weight, None)  # the kernel takes K in pairs
    x = torch.randn(16, 63, generator=gen).bfloat16()
    with torch.inference_mode():
        out = odd(x)
    assert odd._kind != "panel"
    torch.testing.assert_close(
        out.double(), F.linear(x.double(), weight.double()), rtol=2**-7, atol=1e-2
    )


@pytest.mark.parametrize(
    ("choice", "flags", "vendor", "bf16", "fp32"),
    [
        ("auto", {"avx512f", "avx512_bf16"}, "AuthenticAMD", True, True),
        ("auto", {"avx512f", "avx512_bf16", "amx_bf16"}, "GenuineIntel", False, False),
        ("auto", {"avx512f", "avx512_bf16"}, "GenuineIntel", True, False),
        ("auto", set(), "AuthenticAMD", False, False),
        ("0", {"avx512f", "avx512_bf16"}, "AuthenticAMD", False, False),
        ("1", {"avx512f", "avx512_bf16", "amx_bf16"}, "GenuineIntel", True, True),
    ],
)
def test_the_choice_follows_the_cpu_and_the_override(
    choice: str,
    flags: set[str],
    vendor: str,
    bf16: bool,
    fp32: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which CPUs `auto` picks, read from flags and vendor (the kernel's own probe stands in for
    the instructions, so this runs on any CPU that has them both)."""
    for dtype in (torch.float32, torch.bfloat16):
        if not panel_gemm._kernel_works(dtype):
            pytest.skip(f"no {dtype} panel kernel on this CPU")
    monkeypatch.setenv(panel_gemm.SWITCH, choice)
    monkeypatch.setattr(panel_gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(panel_gemm, "cpu_vendor", lambda: vendor)
    panel_gemm.chosen.cache_clear()
    try:
        assert panel_gemm.chosen(torch.bfloat16) is bf16
        assert panel_gemm.chosen(torch.float32) is fp32
        assert panel_gemm.chosen(torch.float16) is False
    finally:
        panel_gemm.chosen.cache_clear()


def test_a_bad_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(panel_gemm.SWITCH, "fast")
    panel_gemm.chosen.cache_clear()
    try:
        with pytest.raises(ValueError, match="PDSERVE_PANEL_GEMM='fast': expected one of"):
            panel_gemm.chosen(torch.float32)
    finally:
        panel_gemm.chosen.cache_clear()
