"""Decode attention read straight from the paged KV pool (kernels/paged_decode.c), on CPU.

Why hand-written: torch has no paged attention on CPU, so a decode step gathered every
sequence's K/V blocks into a padded copy per layer and ran SDPA over the copy. At SmolLM2's
shapes under serving load (batch ~30, ~300-token contexts) that gather was 15% of the decode
engine's time and attention 27% (py-spy, docs/performance.md). The kernel reads each key and
value once, where it lies, with fp32 accumulation.

It is compiled once per machine with the system C compiler (`$CC`, else `cc`) into
`$PDSERVE_KERNEL_CACHE` (default ~/.cache/pdserve/kernels), keyed by the source, the flags and the
CPU, and loaded with ctypes; it shares torch's OpenMP runtime (the same `libgomp.so.1`) and
takes torch's thread count. No compiler, a failed build or `PDSERVE_PAGED_DECODE=0`: attention
keeps the gather + SDPA path, with one log line saying why.

Used for bf16 only: fp32 keeps SDPA so that fp32 outputs stay bit-identical to what the parity
tests pin (the kernel sums in another order).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.model.forward_batch import AttentionGroup

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "paged_decode.c"
# -ffast-math lets the dot products reassociate and expf vectorise (glibc's libmvec); the kernel
# uses no infinities and tests NaN on the integer bits. It is given to the compile step only:
# linking with it would add crtfastmath.o, which sets flush-to-zero for the whole process (torch's
# fp32 included) when the library loads.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-march=native", "-mprefer-vector-width=512", "-fPIC",
                 "-fopenmp", "-std=c11")  # fmt: skip
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0
KERNEL_DTYPES = (torch.bfloat16,)
_BF16 = {torch.bfloat16: 1, torch.float32: 0}
_ARGTYPES = (
    [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int64]
    + [ctypes.c_int] * 2
)  # fmt: skip


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def _cpu_key() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return platform.machine() + flags


def library_path(compiler: str) -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes()
        + " ".join((compiler, *COMPILE_FLAGS, *LINK_FLAGS)).encode()
        + _cpu_key().encode()
    ).hexdigest()[:16]
    return cache_dir() / f"paged_decode-{key}.so"


def build(compiler: str) -> Path:
    """The kernel's shared library, compiled now unless this machine already has it."""
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        _run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)])
        _run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"])
        os.replace(lib, target)  # atomic: concurrent builders each install a whole file
    return target


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason logged once) where it cannot be used."""
    if os.environ.get("PDSERVE_PAGED_DECODE", "1") == "0":
        log.info("paged decode kernel off (PDSERVE_PAGED_DECODE=0): gather + SDPA")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: decode attention gathers K/V and runs SDPA")
        return None
    try:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded before the kernel's
        lib = ctypes.CDLL(str(build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("paged decode kernel unavailable (%s): gather + SDPA", e)
        return None
    lib.paged_decode.argtypes = _ARGTYPES
    lib.paged_decode.restype = ctypes.c_int
    log.info("bf16 decode attention reads the paged KV pool directly (%s)", lib._name)
    return lib


def usable(q: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup) -> bool:
    return (
        group.query_len == 1
        and not group.fresh
        and q.device.type == "cpu"
        and q.dtype in KERNEL_DTYPES
        and layer_pool.dtype == q.dtype
        and layer_pool.is_contiguous()
        and q.stride(-1) == 1
        and library() is not None
    )


def decode_attention(
    q: torch.Tensor, layer_pool: torch.Tensor, group: AttentionGroup, scale: float,
    window: int | None,
) -> torch.Tensor | None:  # fmt: skip
    """[G, heads * head_dim]: the group's single queries over their paged context, or None when
    the kernel declines the shape (the caller then runs SDPA). q: [T, heads, head_dim]."""
    lib = library()
    assert lib is not None and group.kv_blocks is not None
    rows = q if group.query_rows is None else q.index_select(0, group.query_rows)
    n_seqs, num_heads, head_dim = rows.shape
    _, num_blocks, block_size, kv_heads, _ = layer_pool.shape
    blocks = group.kv_blocks.view(n_seqs, -1)
    pos = group.query_pos[:, 0].contiguous()
    out = rows.new_empty(n_seqs, num_heads * head_dim)
    code = lib.paged_decode(
        rows.data_ptr(), layer_pool.data_ptr(), out.data_ptr(), blocks.data_ptr(),
        pos.data_ptr(), n_seqs, blocks.shape[1], num_heads, kv_heads, head_dim, num_blocks,
        block_size, rows.stride(0), rows.stride(1), scale, window or 0, _BF16[q.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    return out if code == 0 else None
