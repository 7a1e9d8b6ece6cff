"""Compile the C kernels under `kernels/` into shared libraries, one per kernel and CPU variant
(kernel_catalog.py), with the system C compiler: `pdserve build-kernels` (also
`python -m shared.model.kernel_build`, which the image's build stage runs without torch).

A library is named `<kernel>.<variant>.<key>.so`, the key a hash of every kernel source and the
flags: the loader (native.py) finds the library for the sources it ships without a compiler, and
a changed source never loads an old build. Libraries go to `--out`, else `$PDSERVE_KERNEL_DIR`
(an image's prebuilt set), else the per-user cache (`$PDSERVE_KERNEL_CACHE`, default
~/.cache/pdserve/kernels), where a first start without prebuilt libraries also builds.

Why not torch's cpp_extension: it needs the C++ toolchain and torch's headers and takes tens of
seconds per kernel; these are plain C over raw pointers, built in seconds by any `cc`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from shared.model.kernel_catalog import KERNELS, Variant, select, variants

SOURCES = Path(__file__).parent / "kernels"
# -ffast-math lets the dot products reassociate and expf vectorise (glibc's libmvec); the kernels
# use no infinities and test NaN on the integer bits. It is given to the compile step only:
# linking with it would add crtfastmath.o, which sets flush-to-zero for the whole process (torch's
# fp32 included) when a library loads. The libraries link against the libgomp.so.1 torch loads
# first, so their OpenMP threads are torch's.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-fopenmp", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 300.0


def cache_dir() -> Path:
    """The per-user build directory (first-start builds, and `build-kernels` by default)."""
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", default))


def prebuilt_dir() -> Path | None:
    """`$PDSERVE_KERNEL_DIR`: where an image (or an operator) put libraries built ahead."""
    value = os.environ.get("PDSERVE_KERNEL_DIR", "")
    return Path(value) if value else None


def search_dirs() -> list[Path]:
    """Where the loader looks for a library, first match wins."""
    prebuilt = prebuilt_dir()
    return [prebuilt, cache_dir()] if prebuilt is not None else [cache_dir()]


def machine() -> str:
    return platform.machine()


def compiler() -> str | None:
    """The C compiler's path: `$CC`, else `cc`; None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


@cache
def _sources_digest() -> bytes:
    digest = hashlib.sha256()
    # every kernel file: a kernel may include another's source (decode_stack.c does)
    for path in sorted([*SOURCES.glob("*.h"), *SOURCES.glob("*.c")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.digest()


def library_name(name: str, variant: Variant) -> str:
    digest = hashlib.sha256(_sources_digest())
    digest.update(" ".join((*COMPILE_FLAGS, *variant.flags, *LINK_FLAGS)).encode())
    return f"{name}.{variant.name}.{digest.hexdigest()[:16]}.so"


def build(name: str, variant: Variant, out_dir: Path, cc: str) -> tuple[Path, bool]:
    """Kernel `name`'s library for `variant` in `out_dir`: (its path, whether it was built now
    rather than found)."""
    target = out_dir / library_name(name, variant)
    if target.exists():
        return target, False
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        source = SOURCES / f"{name}.c"
        _run([cc, *COMPILE_FLAGS, *variant.flags, "-c", str(source), "-o", str(obj)])
        _run([cc, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"])
        os.replace(lib, target)  # atomic: concurrent builders each install a whole file
    return target, True


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")


def build_all(
    out_dir: Path, chosen: list[Variant], cc: str, say: Callable[[str], None] = print
) -> int:
    """Every kernel for every variant in `chosen`, compiled in parallel; one line per library
    through `say`. Returns the number that failed."""
    jobs = [(name, v) for v in chosen for name in KERNELS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(build, name, v, out_dir, cc) for name, v in jobs]
        failed = 0
        for (name, variant), future in zip(jobs, futures, strict=True):
            what = f"{name} for {variant.name} ({variant.summary})"
            try:
                path, built = future.result()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                failed += 1
                say(f"FAILED {what}: {e}")
                continue
            say(f"{'built' if built else 'up to date'} {what}: {path}")
    return failed


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(f"{v.name} ({v.summary})" for v in variants(machine()))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory to write (default: $PDSERVE_KERNEL_DIR, else $PDSERVE_KERNEL_CACHE, "
        "else ~/.cache/pdserve/kernels); the loader reads $PDSERVE_KERNEL_DIR and the cache",
    )
    p.add_argument(
        "--variants",
        default="all",
        help=f"comma-separated CPU variants, or all (default). This machine's: {names}",
    )
    p.add_argument("--cc", default=None, help="the C compiler (default: $CC, else cc)")


def run(a: argparse.Namespace) -> int:
    try:
        chosen = select(machine(), a.variants)
    except ValueError as e:
        print(f"pdserve build-kernels: {e}", file=sys.stderr)
        return 2
    cc = shutil.which(a.cc) if a.cc else compiler()
    if cc is None:
        print(
            f"pdserve build-kernels: no C compiler ({a.cc or os.environ.get('CC', 'cc')}): "
            "install gcc (Debian: apt-get install gcc libc6-dev) or pass --cc",
            file=sys.stderr,
        )
        return 2
    out = a.out or prebuilt_dir() or cache_dir()
    failed = build_all(out, chosen, cc)
    total = len(chosen) * len(KERNELS)
    print(f"{total - failed} of {total} kernel libraries in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve build-kernels", description="compile the C kernels for every CPU variant"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
