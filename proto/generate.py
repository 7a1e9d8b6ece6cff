"""Regenerate the committed Python stubs for proto/pdserve/v1/*.proto.

Run from anywhere (it changes to the repository root, because the import path of the generated
modules, ``proto.pdserve.v1.*_pb2``, comes from the ``-I.`` root)::

    python proto/generate.py           # rewrite the stubs in place
    python proto/generate.py --check   # regenerate into a temp dir, diff, exit 1 on any difference

The stubs are committed so that running pdserve never needs grpcio-tools; ``--check`` (also run by
tests/test_proto.py) catches a .proto edited without regenerating, or regenerated with a different
grpcio-tools version.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("proto/pdserve/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[str]:
    # Sorted relative paths: protoc embeds the path in each descriptor, so it must not depend on
    # the caller's cwd or on directory listing order.
    return sorted((PROTO_DIR / p.name).as_posix() for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))


def is_generated(name: str) -> bool:
    return name.endswith(GENERATED_SUFFIXES)


def run_protoc(out_dir: Path) -> None:
    """Generate stubs for every .proto under PROTO_DIR into out_dir (mirroring the tree)."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files(),
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}")


def generated_files(root: Path) -> dict[str, str]:
    """Map file name -> contents for the generated stubs under root/PROTO_DIR."""
    directory = root / PROTO_DIR
    return {
        p.name: p.read_text(encoding="utf-8")
        for p in sorted(directory.iterdir())
        if p.is_file() and is_generated(p.name)
    }


def check() -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-protoc-") as tmp:
        run_protoc(Path(tmp))
        fresh = generated_files(Path(tmp))
    committed = generated_files(REPO_ROOT)
    problems: list[str] = []
    for name in sorted(fresh.keys() | committed.keys()):
        path = (PROTO_DIR / name).as_posix()
        if name not in committed:
            problems.append(f"missing: {path}\n")
        elif name not in fresh:
            problems.append(f"stale (no .proto generates it): {path}\n")
        elif fresh[name] != committed[name]:
            problems.extend(
                difflib.unified_diff(
                    committed[name].splitlines(keepends=True),
                    fresh[name].splitlines(keepends=True),
                    fromfile=f"committed/{path}",
                    tofile=f"regenerated/{path}",
                )
            )
    if problems:
        sys.stdout.writelines(problems)
        print("\ngenerated stubs are out of date: run `python proto/generate.py`", file=sys.stderr)
        return 1
    print(f"generated stubs up to date ({len(committed)} files)")
    return 0


def generate() -> int:
    with tempfile.TemporaryDirectory(prefix="pdserve-protoc-") as tmp:
        run_protoc(Path(tmp))
        fresh_dir = Path(tmp) / PROTO_DIR
        target = REPO_ROOT / PROTO_DIR
        # Remove stubs of deleted .proto files so they cannot be imported by accident.
        for old in target.iterdir():
            if old.is_file() and is_generated(old.name) and not (fresh_dir / old.name).exists():
                old.unlink()
        for new in sorted(fresh_dir.iterdir()):
            if new.is_file() and is_generated(new.name):
                shutil.copyfile(new, target / new.name)
                print(f"wrote {(PROTO_DIR / new.name).as_posix()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temp dir and exit 1 if the committed stubs differ",
    )
    args = parser.parse_args(argv)
    return check() if args.check else generate()


if __name__ == "__main__":
    sys.exit(main())
