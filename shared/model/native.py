"""Load the C kernels under `kernels/` (bf16 and fp32 CPU ops torch has no fast path for) with
ctypes: for each kernel, the best variant this CPU runs, prebuilt or built now.

The variants and what each requires of the CPU are kernel_catalog.py's; libraries are built by
kernel_build.py (`pdserve build-kernels`, or an image's build stage). At load the loader reads
the CPU's flags (`PDSERVE_KERNEL_CPU_FLAGS`, spaces or commas, stands in for them: a test tells it
the CPU is a lesser one) and takes the best variant the CPU runs that has a library in
`$PDSERVE_KERNEL_DIR` or the per-user cache. Where that best variant has none and a C compiler
exists (`$CC`, else `cc`), it is built into the cache first, with one WARNING line.

Every kernel's outcome is a `KernelState`, logged at start-up (`log_states`) and served on
/version (`states`): on (variant, path), or off and why: its switch variable set to 0, a CPU
without the instructions its paths need, no library and no compiler, a failed build or load.
Off: `load` returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model import kernel_build
from shared.model.kernel_catalog import KERNELS, Kernel, Variant, runnable

log = logging.getLogger(__name__)

CPU_FLAGS_ENV = "PDSERVE_KERNEL_CPU_FLAGS"


def _cpuinfo_field(name: str) -> str:
    """The first `name : value` line of /proc/cpuinfo ('' where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln for ln in lines if ln.split(":")[0].strip() == name), "")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where there is none)."""
    line = _cpuinfo_field("vendor_id")
    return line.split(":", 1)[1].strip() if ":" in line else ""


def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's CPU flags (empty where there is none)."""
    line = _cpuinfo_field("flags")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def kernel_cpu_flags() -> frozenset[str]:
    """The flags the loader picks variants by: `$PDSERVE_KERNEL_CPU_FLAGS`, else the CPU's."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(override.replace(",", " ").split())
    return cpu_flags()


@dataclass(frozen=True)
class KernelState:
    """A kernel's outcome here. `detail`: why it is off, or (on) the paths its build leaves
    out; `act`: a person can fix it by building (a missing or failed library)."""

    kernel: str
    on: bool
    variant: str = ""
    path: str = ""
    detail: str = ""
    act: bool = False

    def as_dict(self) -> dict[str, str]:
        if not self.on:
            return {"state": "off", "reason": self.detail}
        found = {"state": "on", "variant": self.variant, "path": self.path}
        return found | ({"note": self.detail} if self.detail else {})

    def describe(self) -> str:
        if not self.on:
            return f"off ({self.detail})"
        return f"on ({self.variant}, {self.path})" + (f"; {self.detail}" if self.detail else "")


_states: dict[str, KernelState] = {}


def resolve(name: str, cpu: frozenset[str] | None = None) -> KernelState:
    """Kernel `name`'s library for a CPU with flags `cpu` (default: kernel_cpu_flags()), built
    now where the best variant it runs has none and a compiler exists. Recorded for `states`."""
    state = _resolve(KERNELS[name], kernel_cpu_flags() if cpu is None else cpu)
    _states[name] = state
    return state


def _resolve(kernel: Kernel, cpu: frozenset[str]) -> KernelState:
    if os.environ.get(kernel.switch, "1") == "0":
        return KernelState(kernel.name, False, detail=f"disabled by {kernel.switch}=0")
    if kernel.paths and not kernel.covered(cpu):
        return KernelState(kernel.name, False, detail=f"CPU lacks {', '.join(kernel.lacking(cpu))}")
    candidates = runnable(kernel_build.machine(), cpu)
    found, error = _find(kernel.name, candidates), ""
    best = candidates[0]
    if found is None or found[0] != best:
        built, error = _build_now(kernel, best, found)
        found = (best, built) if built is not None else found
    if found is None:
        dirs = " or ".join(str(d) for d in kernel_build.search_dirs())
        why = (
            f"build failed: {error}"
            if error
            else (
                f"no library for {best.name} or a lesser variant in {dirs} and no C compiler to "
                "build one: run `pdserve build-kernels`"
            )
        )
        return KernelState(kernel.name, False, detail=why, act=True)
    variant, path = found
    covered = kernel.covered(variant.requires)
    if kernel.paths and not covered:
        why = f"the {variant.name} build has no path for this CPU: run `pdserve build-kernels`"
        return KernelState(kernel.name, False, detail=why, act=True)
    left = [_left_out(kernel, p, variant, cpu) for p in kernel.paths if p not in covered]
    return KernelState(kernel.name, True, variant.name, str(path), "; ".join(left))


def _left_out(kernel: Kernel, path: str, variant: Variant, cpu: frozenset[str]) -> str:
    lacking = sorted(kernel.paths[path] - cpu)
    if lacking:
        return f"{path} path off: CPU lacks {', '.join(lacking)}"
    return f"{path} path off: not in the {variant.name} build"


def _find(name: str, candidates: list[Variant]) -> tuple[Variant, Path] | None:
    """The best of `candidates` with a library in a search directory."""
    for variant in candidates:
        for directory in kernel_build.search_dirs():
            path = directory / kernel_build.library_name(name, variant)
            if path.is_file():
                return variant, path
    return None


def _build_now(
    kernel: Kernel, variant: Variant, found: tuple[Variant, Path] | None
) -> tuple[Path | None, str]:
    """`variant`'s library built into the per-user cache: (its path, '') or (None, the error;
    '' where there is no compiler)."""
    cc = kernel_build.compiler()
    if cc is None:
        return None, ""
    start = time.monotonic()
    try:
        path, built = kernel_build.build(kernel.name, variant, kernel_build.cache_dir(), cc)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if found is not None:
            log.warning(
                "%s: building %s failed (%s); %s kept", kernel.what, variant.name, e, found[0].name
            )
        return None, str(e)
    if built:
        log.warning(
            "%s: no prebuilt library for this CPU's best variant, built %s for %s (%s) in "
            "%.1fs: %s (`pdserve build-kernels` builds every variant ahead of time)",
            kernel.what,
            kernel.name,
            variant.name,
            variant.summary,
            time.monotonic() - start,
            path,
        )
    return path, ""


def build(name: str, compiler: str) -> Path:
    """Kernel `name`'s library for the best variant this CPU runs, in the per-user cache
    (compiled now unless it is there)."""
    best = runnable(kernel_build.machine(), kernel_cpu_flags())[0]
    return kernel_build.build(name, best, kernel_build.cache_dir(), compiler)[0]


def states() -> dict[str, KernelState]:
    """Every kernel's state: as its library was loaded, or resolved now for one not loaded."""
    return {name: _states.get(name) or resolve(name) for name in KERNELS}


def log_states() -> None:
    """One line per kernel (WARNING where a person can turn an off kernel on)."""
    for name, state in states().items():
        log.log(
            logging.WARNING if state.act else logging.INFO,
            "C kernel %s: %s",
            name,
            state.describe(),
        )


Signatures = dict[str, tuple[list[type], type | None]]


def call(name: str, entry: Callable[..., int], *args: object) -> int:
    """`entry(*args)`, a kernel's entry point; while torch's profiler records, under a row named
    `name` ("pdserve::<kernel>"): a ctypes call is no aten op, so without it a profile's op table
    leaves the kernel's time out (the roofline's breakdown gave the GEMMs 99% of a 4k-token bf16
    prefill whose attention took half)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return entry(*args)
    return entry(*args)


def load(name: str, switch: str, what: str, signatures: Signatures) -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason logged) where it cannot be used.

    `switch`: the environment variable that turns it off with "0" (kernel_catalog.py's);
    `what`: its name in logs; `signatures`: each entry point's argument types and result type,
    set on the library.
    """
    assert KERNELS[name].switch == switch, f"{name}: {switch} is not its switch"
    state = resolve(name)
    if state.on:
        try:
            torch.get_num_threads()  # torch's OpenMP runtime is loaded before the kernel's
            lib = ctypes.CDLL(state.path)
        except OSError as e:
            state = _states[name] = KernelState(name, False, detail=f"load failed: {e}", act=True)
    if not state.on:
        off = "unavailable" if state.act else "off"
        log.log(
            logging.WARNING if state.act else logging.INFO,
            "%s %s (%s): torch path",
            what,
            off,
            state.detail,
        )
        return None
    for symbol, (args, result) in signatures.items():
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = args, result
    return lib
