"""Build, cache and load the C kernels under `kernels/` (bf16 CPU ops torch has no fast path for).

Each kernel is one C file, compiled once per machine with the system C compiler (`$CC`, else
`cc`) into `$PDSERVE_KERNEL_CACHE` (default ~/.cache/pdserve/kernels), keyed by every kernel
source and header, the flags and the CPU, and loaded with ctypes. The libraries link against the
same `libgomp.so.1` torch uses, so their OpenMP threads are torch's; callers pass torch's thread
count. No compiler, a failed build or the kernel's switch variable set to 0: `load` returns None
after one log line, and the caller keeps its torch path.

Why not torch's cpp_extension: it needs the C++ toolchain and torch's headers at run time and
builds in tens of seconds per kernel; these are plain C over raw pointers, built in about a
second by any `cc`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
# -ffast-math lets the dot products reassociate and expf vectorise (glibc's libmvec); the kernels
# use no infinities and test NaN on the integer bits. It is given to the compile step only:
# linking with it would add crtfastmath.o, which sets flush-to-zero for the whole process (torch's
# fp32 included) when a library loads.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-march=native", "-mprefer-vector-width=512", "-fPIC",
                 "-fopenmp", "-std=c11")  # fmt: skip
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


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


def _cpu_key() -> str:
    return platform.machine() + _cpuinfo_field("flags")


def source(name: str) -> Path:
    return KERNELS / f"{name}.c"


def library_path(name: str, compiler: str) -> Path:
    digest = hashlib.sha256(source(name).read_bytes())
    # every kernel file: a kernel may include another's source (decode_stack.c does)
    for dependency in sorted([*KERNELS.glob("*.h"), *KERNELS.glob("*.c")]):
        digest.update(dependency.read_bytes())
    digest.update(" ".join((compiler, *COMPILE_FLAGS, *LINK_FLAGS)).encode())
    digest.update(_cpu_key().encode())
    return cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def build(name: str, compiler: str) -> Path:
    """Kernel `name`'s shared library, compiled now unless this machine already has it."""
    target = library_path(name, compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        _run([compiler, *COMPILE_FLAGS, "-c", str(source(name)), "-o", str(obj)])
        _run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"])
        os.replace(lib, target)  # atomic: concurrent builders each install a whole file
    return target


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")


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

    `switch`: the environment variable that turns it off with "0"; `what`: its name in logs;
    `signatures`: each entry point's argument types and result type, set on the library.
    """
    if os.environ.get(switch, "1") == "0":
        log.info("%s off (%s=0): torch path", what, switch)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: %s unavailable, torch path", what)
        return None
    try:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded before the kernel's
        lib = ctypes.CDLL(str(build(name, compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("%s unavailable (%s): torch path", what, e)
        return None
    for symbol, (args, result) in signatures.items():
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = args, result
    return lib
