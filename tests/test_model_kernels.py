"""The fast kernels in shared/model compute the same bits as the formulas they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import gemm as gemm_module
from shared.model import panel_gemm
from shared.model.config import ModelConfig
from shared.model.gemm import (
    EXACT_ROWS,
    GEMV_ROWS,
    PackedGemm,
    onednn_bf16_available,
    padded_rows,
)
from shared.model.llama import RMSNorm, RotaryEmbedding, apply_rotary, rotate_half

DTYPES = [torch.float32, torch.bfloat16]


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=96,
        intermediate_size=64,
        num_layers=1,
        num_heads=3,
        num_kv_heads=1,
        head_dim=32,
        rope_theta=100000.0,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_transformers_formula_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(300)
    # q and k heads as the model rotates them: a strided slice of the fused qkv output
    qkv = torch.randn(300, 5, 32, generator=gen).to(dtype)
    x = qkv[:, :4]
    cos, signed_sin = RotaryEmbedding(_config(), torch.device("cpu"))(positions, dtype)
    freqs = positions[:, None].float() * RotaryEmbedding(_config(), torch.device("cpu")).inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin().to(dtype)[:, None]
    assert torch.equal(cos, emb.cos().to(dtype)[:, None])
    assert torch.equal(apply_rotary(x, cos, signed_sin), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_llama_rms_norm_bitwise(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 96, generator=gen).to(dtype)
    ours = RMSNorm(96, 1e-5, torch.device("cpu"), dtype)
    theirs = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_gemm_equals_linear_and_sees_weight_updates(
    rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gemm_module, "_gemv", lambda dtype: None)  # one row: a library here too
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(80, 96, generator=gen).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    gemm = PackedGemm(weight, bias)
    with torch.inference_mode():
        assert_same(gemm(x), F.linear(x, weight, bias), dtype)
    weight.mul_(-2)  # a checkpoint loaded after the first forward: the packed copy is rebuilt
    with torch.inference_mode():
        assert_same(gemm(x), F.linear(x, weight, bias), dtype)
    if panel_gemm.chosen(dtype):
        assert gemm._kind == "panel"  # where the libraries are slower: the panel kernel
    elif dtype == torch.bfloat16 and onednn_bf16_available():
        assert gemm._packed is not None  # took the oneDNN path
    elif dtype == torch.float32 and torch.backends.mkldnn.is_available():
        assert gemm._packed is not None  # decode batches: oneDNN too
    else:
        assert gemm._packed is None


def assert_same(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """bf16: oneDNN's bits, as `F.linear` runs oneDNN too (the panel kernel, which sums in
    another order: within one bf16 step of them); fp32: MKL's result within a few ulps (oneDNN
    and the panel kernel sum in other orders)."""
    if dtype == torch.bfloat16 and panel_gemm.chosen(dtype):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-6)
    elif dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.fixture
def fp32_gemm(monkeypatch: pytest.MonkeyPatch):
    """Sets PDSERVE_FP32_GEMM for one test (the choice is read once per process)."""

    def choose(value: str) -> None:
        monkeypatch.setenv("PDSERVE_FP32_GEMM", value)
        gemm_module.fp32_rows_onednn.cache_clear()

    yield choose
    gemm_module.fp32_rows_onednn.cache_clear()


@pytest.mark.parametrize("choice", ["mkl", "onednn"])
def test_fp32_prefill_rows_follow_the_choice(
    choice: str, fp32_gemm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More rows than a decode batch: `mkl` is `F.linear` itself, transformers' library and
    bits, even where the panel kernel runs fp32; `onednn` the packed copy, within float rounding
    of it (rows padded to a bucket)."""
    fp32_gemm(choice)
    if choice == "onednn":
        monkeypatch.setattr(panel_gemm, "chosen", lambda dtype: False)  # the libraries' paths
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(80, 96, generator=gen)
    bias = torch.randn(80, generator=gen)
    gemm = PackedGemm(weight, bias)
    for rows in (EXACT_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=gen)
        with torch.inference_mode():
            out = gemm(x)
        if choice == "mkl":
            assert torch.equal(out, F.linear(x, weight, bias))
            assert gemm._packed is None
        elif torch.backends.mkldnn.is_available():
            assert out.shape == (rows, 80) and gemm._packed is not None
            torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_fp32_gemm_auto_follows_the_vendor_and_bad_values_are_refused(
    fp32_gemm, monkeypatch: pytest.MonkeyPatch
) -> None:
    for vendor, onednn in (("GenuineIntel", False), ("AuthenticAMD", True), ("", False)):
        monkeypatch.setattr(gemm_module, "cpu_vendor", lambda vendor=vendor: vendor)
        fp32_gemm("auto")
        assert gemm_module.fp32_rows_onednn() is onednn
    fp32_gemm("fast")
    with pytest.raises(ValueError, match="PDSERVE_FP32_GEMM='fast': expected one of"):
        gemm_module.fp32_rows_onednn()


@pytest.mark.parametrize(("out_features", "in_features"), [(80, 96), (37, 100), (3072, 576)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_few_rows_go_to_the_gemv_kernel(
    out_features: int, in_features: int, threads: int, dtype: torch.dtype
) -> None:
    """Within one bf16 step of oneDNN's result (sums in another order), rarely off at all; fp32
    within float rounding of a float64 reference; reads the weight as stored, so an in-place
    update is seen; no packed copy is built for it."""
    if gemm_module._gemv(dtype) is None:
        pytest.skip(f"no {dtype} GEMV kernel on this CPU")
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    gemm = PackedGemm(weight, bias)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for rows in range(1, GEMV_ROWS[dtype] + 1):
                x = torch.randn(rows, in_features, generator=gen).to(dtype)
                out = gemm(x)
                if dtype == torch.bfloat16:
                    ref = F.linear(x, weight, bias)
                    steps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
                    assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02
                else:
                    ref64 = F.linear(x.double(), weight.double(), bias.double())
                    torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-4)
                weight.mul_(-2)
    finally:
        torch.set_num_threads(before)
    assert gemm._packed is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_kernel_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """A row's output is the same bits alone, in any kernel-sized batch and any position in it,
    with x rows strided (a view of a wider tensor), K not a multiple of the vector width."""
    if gemm_module._gemv(dtype) is None:
        pytest.skip(f"no {dtype} GEMV kernel on this CPU")
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(50, 77, generator=gen).to(dtype)
    wide = torch.randn(GEMV_ROWS[dtype], 100, generator=gen).to(dtype)
    x = wide[:, 3:80]  # row stride 100, unit element stride
    gemm = PackedGemm(weight, None)
    with torch.inference_mode():
        batched = gemm(x)
        for i in range(x.shape[0]):
            assert torch.equal(gemm(x[i : i + 1]), batched[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_kernel_any_row_count(dtype: torch.dtype) -> None:
    """The kernel's contract is any row count (the engine sends at most GEMV_ROWS): up to 4 rows
    each row has the bits it has alone, in fp32 too; 11 rows (a pass of 8, one of 3) are right
    within the dtype's rounding of a float64 reference."""
    if gemm_module._gemv(dtype) is None:
        pytest.skip(f"no {dtype} GEMV kernel on this CPU")
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 70, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(11, 70, generator=gen).to(dtype)
    with torch.inference_mode():
        four = gemm_module._gemv_rows(x[:4], weight, bias)
        for i in range(4):
            assert torch.equal(gemm_module._gemv_rows(x[i : i + 1], weight, bias), four[i : i + 1])
        got = gemm_module._gemv_rows(x, weight, bias)
    want = F.linear(x.double(), weight.double(), bias.double())
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("rows", [33, 300, 513])
def test_packed_gemm_padded_rows_match_linear(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(panel_gemm, "chosen", lambda dtype: False)  # oneDNN's padded rows
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(80, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    with torch.inference_mode():
        out = PackedGemm(weight, None)(x)
        ref = F.linear(x.float(), weight.float())
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=0.1)


def test_padded_rows_are_few_and_tight() -> None:
    sizes = {padded_rows(m) for m in range(1, 16385)}
    assert len(sizes) <= EXACT_ROWS + 8 * 9  # 8 per octave from 32 to 16k: the cache holds them
    for m in range(1, 16385):
        p = padded_rows(m)
        assert p == m if m <= EXACT_ROWS else m <= p <= m * 1.125
        assert padded_rows(p) == p  # a padded size is its own bucket
