"""scripts/gpu-check on CPU: the dry run passes (wheel list, test selection and benchmark plan
are consistent) and its wheel checks catch what would break the install on the GPU machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
# rmm-cu12 (the Python package) is not needed: ucxx loads librmm through librmm-cu12 (the H200
# run pushed KV over UCX without it)
UCX_STACK = {"ucxx-cu12", "libucxx-cu12", "libucx-cu12", "librmm-cu12"}


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_passes() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry-run: ok" in out.stdout
    assert "9 cuda tests in 3 files" in out.stdout
    assert "bench plan ok" in out.stdout


def test_wheel_list_names_the_ucx_stack(gpu_check: ModuleType) -> None:
    listed = dict(gpu_check.parse_wheel_list())
    assert set(listed) >= UCX_STACK
    assert all(v[0].isdigit() for v in listed.values())


def fake_wheels(folder: Path, entries: list[tuple[str, str]]) -> None:
    folder.mkdir(exist_ok=True)
    for name, version in entries:
        dist = name.replace("-", "_")
        (folder / f"{dist}-{version}-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"x")


def test_wheel_check_catches_missing_extra_and_duplicate_wheels(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    listed = gpu_check.parse_wheel_list()
    fake_wheels(tmp_path / "ok", listed)
    assert gpu_check.check_wheels(tmp_path / "ok")[0] == []

    fake_wheels(tmp_path / "missing", listed[1:])
    (problem,) = gpu_check.check_wheels(tmp_path / "missing")[0]
    assert listed[0][0] in problem and "0 wheels" in problem

    fake_wheels(tmp_path / "extra", [*listed, ("torch", "2.11.0")])
    assert gpu_check.check_wheels(tmp_path / "extra")[0] == [
        "torch: wheel in " + str(tmp_path / "extra") + " but not in the list"
    ]

    name, version = listed[0]
    fake_wheels(tmp_path / "two", [*listed, (name, version + ".post1")])
    (problem,) = gpu_check.check_wheels(tmp_path / "two")[0]
    assert "2 wheels" in problem

    assert gpu_check.check_wheels(tmp_path / "absent")[0] == []  # not downloaded: only a note


def test_wheel_names_parse_like_pip(gpu_check: ModuleType) -> None:
    parse = gpu_check.wheel_name_version
    name = "ucxx_cu12-0.52.0-cp311-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    assert parse(name) == ("ucxx-cu12", "0.52.0")
    assert parse("grpcio_health_checking-1.85.1-py3-none-any.whl") == (
        "grpcio-health-checking",
        "1.85.1",
    )
    with pytest.raises(ValueError, match="not a wheel"):
        parse("ucxx-0.52.0.tar.gz")


def test_wheel_list_rejects_unpinned_and_repeated_lines(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    bad = tmp_path / "list.txt"
    bad.write_text("# comment\nucxx-cu12>=0.52\n")
    with pytest.raises(ValueError, match="name==version"):
        gpu_check.parse_wheel_list(bad)
    bad.write_text("ucxx-cu12==0.52.0\nucxx_cu12==0.52.0\n")
    with pytest.raises(ValueError, match="listed twice"):
        gpu_check.parse_wheel_list(bad)


def test_a_step_past_its_deadline_is_interrupted(gpu_check: ModuleType, tmp_path: Path) -> None:
    # SIGINT first: the child's finally blocks run (here: it prints on the way out)
    code = "import time\ntry:\n    time.sleep(60)\nfinally:\n    print('unwound', flush=True)\n"
    log = tmp_path / "log"
    status = gpu_check.run_with_deadline([sys.executable, "-c", code], log, dict(os.environ), 1)
    assert status == "timed out after 1s"
    assert "unwound" in log.read_text()
    ok = gpu_check.run_with_deadline([sys.executable, "-c", "pass"], log, dict(os.environ), 30)
    assert ok == 0
