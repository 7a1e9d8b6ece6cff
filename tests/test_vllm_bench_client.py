"""pdserve/bench/peers/vllm_bench_client.py runs under the vLLM venv's python, never pdserve's:
the modules and names it imports must exist in the vLLM installed there. Without that venv (CI
never installs vLLM) the import check skips and says how to create it."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from pdserve.bench.peers import vllm_setup

CLIENT = Path(__file__).resolve().parent.parent / "pdserve/bench/peers/vllm_bench_client.py"


def imported_names(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every `from module import names` in the file, at any depth."""
    return [
        (node.module, [alias.name for alias in node.names])
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.ImportFrom) and node.module
    ]


def test_client_imports_only_vllm_and_the_standard_library() -> None:
    """The client runs without pdserve on its path: it may import vLLM (none of whose modules
    lives under a `pdserve` name) and the future statement, nothing else."""
    modules = [module for module, _ in imported_names(CLIENT)]
    assert "vllm.benchmarks.serve" in modules  # `vllm bench serve`'s parser and main
    for module in modules:
        assert module == "__future__" or module.split(".")[0] == "vllm", module
        assert "pdserve" not in module.split("."), f"{module}: not a vLLM module"


def test_client_targets_import_under_the_peer_venv() -> None:
    if not vllm_setup.venv_ready():
        pytest.skip(
            f"no vLLM peer venv at {vllm_setup.VENV} (create it with "
            "`python -m pdserve.bench.peers.vllm_setup`): the client's imports are unchecked"
        )
    probe = "\n".join(
        f"from {module} import {', '.join(names)}"
        for module, names in imported_names(CLIENT)
        if module != "__future__"
    )
    done = subprocess.run(
        [str(vllm_setup.venv_python()), "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"under {vllm_setup.VENV}:\n{probe}\n{done.stderr[-2000:]}"
