"""What the C kernels under `kernels/` are and what they need of a CPU: the libraries, each
kernel's instruction-set needs per path, and the CPU-feature variants every library is built for.

A variant is one `-march` level; its name says what a CPU must have to run it (never
`-march=native`, so a library built on one machine is right on every CPU that meets its name).
The kernels hold hand-written AVX-512 paths (`#if defined(__AVX512F__)`, bf16 dot products under
`__AVX512BF16__`) and portable C the compiler vectorises for whatever the level gives; built
without AVX-512 those paths are stubs that return -1, so every variant builds every library. No
kernel uses AMX or NEON intrinsics: aarch64 gets one portable level.

Standard library only: the image's build stage runs kernel_build.py with the system Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# /proc/cpuinfo flags of the x86-64 psABI levels (cumulative below)
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# the kernels' AVX-512 loops are written for 512-bit vectors; -march levels tune for 256
_X86 = ("-mprefer-vector-width=512",)


@dataclass(frozen=True)
class Variant:
    """One build of every library: `flags` select the instruction set, `requires` are the
    /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str]
    summary: str

    def runs_on(self, cpu: frozenset[str]) -> bool:
        return self.requires <= cpu


# worst first: the loader takes the last one a CPU runs
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("x86-64", ("-march=x86-64", *_X86), frozenset(), "any x86-64 CPU (SSE2)"),
        Variant("x86-64-v3", ("-march=x86-64-v3", *_X86), _V3, "AVX2 + FMA"),
        Variant("x86-64-v4", ("-march=x86-64-v4", *_X86), _V4, "AVX-512 F/BW/CD/DQ/VL"),
        Variant(
            "x86-64-v4-bf16",
            ("-march=x86-64-v4", "-mavx512bf16", *_X86),
            _V4 | {"avx512_bf16"},
            "AVX-512 + AVX512-BF16",
        ),
    ),
    "aarch64": (Variant("armv8-a", ("-march=armv8-a",), frozenset(), "any ARMv8-A CPU (NEON)"),),
}
# another architecture: the compiler's own default target
GENERIC = Variant("generic", (), frozenset(), "the compiler's default target")

_AVX512 = frozenset({"avx512f"})
_BF16 = frozenset({"avx512f", "avx512_bf16"})
_GEMM_PATHS = {"fp32": _AVX512, "bf16": _BF16}


@dataclass(frozen=True)
class Kernel:
    """One library: `switch` turns it off with "0"; `what` names it in logs; `paths` maps each
    dtype path to the CPU flags it needs (a kernel with none runs on every variant)."""

    name: str
    switch: str
    what: str
    paths: dict[str, frozenset[str]] = field(default_factory=dict)

    def covered(self, cpu: Iterable[str]) -> list[str]:
        """The paths a CPU (or a variant) with flags `cpu` runs."""
        have = frozenset(cpu)
        return [path for path, needs in self.paths.items() if needs <= have]

    def lacking(self, cpu: Iterable[str]) -> list[str]:
        """The flags missing for the kernel's first path."""
        return sorted(next(iter(self.paths.values()), frozenset()) - frozenset(cpu))


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("fused_ops", "PDSERVE_FUSED_OPS", "fused element-wise kernels"),
        Kernel("paged_decode", "PDSERVE_PAGED_DECODE", "paged decode kernel"),
        Kernel("paged_prefill", "PDSERVE_PAGED_PREFILL", "paged prefill kernel", _GEMM_PATHS),
        Kernel("skinny_gemm", "PDSERVE_SKINNY_GEMM", "small-batch GEMM kernel", _GEMM_PATHS),
        Kernel("panel_gemm", "PDSERVE_PANEL_GEMM", "panel GEMM kernel", _GEMM_PATHS),
        # a unity build over fused_ops, paged_decode and skinny_gemm: the GEMMs' needs
        Kernel("decode_stack", "PDSERVE_DECODE_STACK", "one-call decode stack", _GEMM_PATHS),
    )
}


def variants(machine: str) -> tuple[Variant, ...]:
    """The variants built for `machine` (platform.machine()), worst first."""
    return VARIANTS.get(machine, (GENERIC,))


def runnable(machine: str, cpu: frozenset[str]) -> list[Variant]:
    """The variants a CPU with flags `cpu` runs, best first."""
    return [v for v in reversed(variants(machine)) if v.runs_on(cpu)]


def select(machine: str, names: str) -> list[Variant]:
    """Comma-separated variant names ("all": every one of `machine`'s), worst first."""
    known = variants(machine)
    if names.strip() == "all":
        return list(known)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    by_name = {v.name: v for v in known}
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        choices = ", ".join(by_name)
        raise ValueError(f"unknown variant(s) {unknown or names!r} for {machine}: {choices}")
    return [v for v in known if v.name in wanted]
