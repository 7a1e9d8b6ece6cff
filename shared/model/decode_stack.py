"""A small decode batch through every decoder layer in one native call (kernels/decode_stack.c),
on CPU, bf16 or fp32.

Why: at batch 1 a decode step is a pass over the weights, and on SmolLM2 the Python between the
kernels (module calls, shape checks, allocations, nine ctypes calls per layer) took ~3 ms of a
~13 ms bf16 step (docs/performance.md, "Kernels"). In bf16 the native loop calls the very kernels
the layer loop of shared/model/llama.py calls, in the same order on the same kinds of buffers, so
a step's logits are bit-identical either way (tested). In fp32 the layer loop's element-wise ops
are torch's (their bits pinned to transformers' for prefill); the native loop's RMSNorm, RoPE and
SwiGLU product follow the same formulas but may differ in the last bit, as fp32 decode GEMMs
already differ from MKL's (shared/model/gemm.py); greedy tokens stay transformers' (tested).
Taken where the layer loop would run the GEMV and paged decode kernels: one decode group of up to
`gemm.GEMV_ROWS[dtype]` sequences, no layer hook. Anything else keeps the layer loop.
`PDSERVE_DECODE_STACK=0` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator, Sequence

import torch

from shared.model import fused_ops, gemm, native, paged_decode
from shared.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_paused = False


@contextlib.contextmanager
def layer_loop() -> Iterator[None]:
    """Decode steps inside keep the layer loop (a benchmark's baseline in the same run)."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "qkv_w",
            "qkv_b",
            "o_w",
            "o_b",
            "gate_up_w",
            "gate_up_b",
            "down_w",
            "down_b",
            "input_norm",
            "post_norm",
        )
    ] + [("window", _I)]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("M", "hidden", "Hq", "Hk", "D", "inter")),
        *((name, _I) for name in ("num_blocks", "block_size", "blocks_per_seq")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _P) for name in ("cos", "ssin", "slots", "blocks", "pos")),
        ("parallel_elements", _I),
        ("nthreads", ctypes.c_int),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    signatures = {
        "decode_stack_bf16": ([_P, _I, _P, _P, _P, _P, _P], ctypes.c_int),
        "decode_stack_f32": ([_P, _I, _P, _P, _P, _P, _P], ctypes.c_int),
        "decode_stack_work": ([_P], _I),
    }
    lib = native.load("decode_stack", "PDSERVE_DECODE_STACK", "one-call decode stack", signatures)
    if lib is None:
        return None
    log.info("small decode batches run every layer in one call (%s)", lib._name)
    return lib


_ENTRY = {torch.bfloat16: "decode_stack_bf16", torch.float32: "decode_stack_f32"}


def _kernels_on(dtype: torch.dtype) -> bool:
    """Whether the layer loop itself would run the kernels the native loop runs in `dtype` (read
    per step: each kernel's dtypes and availability are its own module's say)."""
    # bf16: the loop's element-wise ops are the fused kernels the stack runs (bit-identical
    # steps); fp32: the stack runs fused_ops.c's fp32 loops, the layer loop those or (where fp32
    # keeps transformers' bits) torch's ops
    fused = dtype in fused_ops.KERNEL_DTYPES and fused_ops.library() is not None
    return (
        not _paused
        and dtype in _ENTRY
        and (fused or dtype == torch.float32)
        and dtype in paged_decode.KERNEL_DTYPES
        and paged_decode.library() is not None
        and gemm.gemv_available(dtype)
        and library() is not None
    )


def covers(dtype: torch.dtype, rows: int) -> bool:
    """Whether a decode step of `rows` sequences in `dtype` is in the stack's range: the rows
    whose GEMMs the layer loop sends to the GEMV kernel."""
    return rows <= gemm.GEMV_ROWS.get(dtype, 0)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    """The decoder layers' weight table for the native call, built on first use."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self._layers = layers
        self._table: ctypes.Array[_Layer] | None = None
        self._weights_ok: bool | None = None

    def _model_ok(self, dtype: torch.dtype) -> bool:
        if self._weights_ok is None:
            self._weights_ok = all(_layer_ok(m, dtype) for m in self._layers)
        return self._weights_ok and _kernels_on(dtype)

    def usable(self, batch: ForwardBatch, x: torch.Tensor, kv_pool: torch.Tensor) -> bool:
        if len(batch.groups) != 1 or x.device.type != "cpu":
            return False
        group = batch.groups[0]
        return (
            group.query_len == 1
            and not group.fresh
            and group.token_rows is None
            and group.query_rows is None
            and batch.num_tokens == batch.num_seqs
            and covers(x.dtype, batch.num_seqs)
            and kv_pool.dtype == x.dtype
            and kv_pool.is_contiguous()
            and self._model_ok(x.dtype)
        )

    def run(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
    ) -> torch.Tensor:
        """Every layer over x [M, hidden] (the residual stream, updated in place, as the layer
        loop leaves it); returns the last layer's MLP output [M, hidden]."""
        lib = library()
        assert lib is not None
        if self._table is None:
            self._table = (_Layer * len(self._layers))(*map(_layer_entry, self._layers))
        step, alive = self._step(x, batch, rope, kv_pool)
        assert all(a.is_contiguous() for a in alive) and x.is_contiguous()
        ref = ctypes.byref(step)
        work = x.new_empty(lib.decode_stack_work(ref))
        out = torch.empty_like(x)
        code = native.call(
            "pdserve::decode_stack",
            getattr(lib, _ENTRY[x.dtype]),
            self._table,
            len(self._layers),
            ref,
            x.data_ptr(),
            kv_pool.data_ptr(),
            work.data_ptr(),
            out.data_ptr(),
        )
        if code == -2:  # attention's per-thread scratch: the step is lost, as on any OOM
            raise MemoryError("decode stack: no memory for attention's scratch")
        if code != 0:  # checked before anything is written
            raise IndexError(
                f"decode stack: a KV slot outside the pool's {num_slots(kv_pool)} or a shape "
                "out of the kernels' range"
            )
        return out

    def _step(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
    ) -> tuple[_Step, tuple[torch.Tensor, ...]]:
        """The step's shapes and pointers for the C side, and the tensors it points into (new
        ones among them), which the caller keeps alive until the call returns."""
        group = batch.groups[0]
        assert group.kv_blocks is not None
        blocks = group.kv_blocks.view(batch.num_seqs, -1)
        pos = group.query_pos[:, 0].contiguous()
        cos, ssin = (t.reshape(t.shape[0], -1) for t in rope)
        attn = self._layers[0].self_attn
        step = _Step(
            M=batch.num_seqs,
            hidden=x.shape[1],
            Hq=attn.num_heads,
            Hk=attn.num_kv_heads,
            D=attn.head_dim,
            inter=self._layers[0].mlp.intermediate_size,
            num_blocks=kv_pool.shape[2],
            block_size=kv_pool.shape[3],
            blocks_per_seq=blocks.shape[1],
            eps=self._layers[0].input_layernorm.eps,
            scale=attn.scale,
            cos=cos.data_ptr(),
            ssin=ssin.data_ptr(),
            slots=batch.slot_mapping.data_ptr(),
            blocks=blocks.data_ptr(),
            pos=pos.data_ptr(),
            parallel_elements=fused_ops.PARALLEL_ELEMENTS,
            nthreads=torch.get_num_threads(),
        )
        return step, (cos, ssin, blocks, pos)


def num_slots(kv_pool: torch.Tensor) -> int:
    return kv_pool.shape[2] * kv_pool.shape[3]


def _plain(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.is_contiguous() and t.dtype == dtype and t.device.type == "cpu")


def _layer_ok(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    tensors = (
        attn.qkv_weight,
        attn.qkv_bias,
        attn.o_proj.weight,
        attn.o_proj.bias,
        mlp.gate_up_weight,
        mlp.gate_up_bias,
        mlp.down_proj.weight,
        mlp.down_proj.bias,
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
    )
    return all(_plain(t, dtype) for t in tensors)


def _layer_entry(layer: torch.nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        _ptr(attn.qkv_weight),
        _ptr(attn.qkv_bias),
        _ptr(attn.o_proj.weight),
        _ptr(attn.o_proj.bias),
        _ptr(mlp.gate_up_weight),
        _ptr(mlp.gate_up_bias),
        _ptr(mlp.down_proj.weight),
        _ptr(mlp.down_proj.bias),
        _ptr(layer.input_layernorm.weight),
        _ptr(layer.post_attention_layernorm.weight),
        attn.window or 0,
    )
