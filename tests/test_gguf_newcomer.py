"""The README's main command answers a real question: `pdserve up --model smollm2 --run
"What is the capital of France?"`, run as a user runs it (the venv's `pdserve` script, separate
node processes), prints an answer containing "Paris" and exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

QUESTION = "What is the capital of France?"


def pdserve_command() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pdserve.cli"]


def test_readme_main_command_answers_paris() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f'pdserve up --model smollm2 --run "{QUESTION}"' in readme
    # --port 0: an ephemeral port, so a concurrent test run cannot collide on 50051
    cmd = [*pdserve_command(), "up", "--model", "smollm2", "--run", QUESTION, "--port", "0"]
    # as a user runs it: the machine's own dtype default, not the suite's fp32 pin
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_AUTO_DTYPE"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Paris" in done.stdout, done.stdout  # the answer, alone on stdout
    assert "loading SmolLM2-135M-Instruct.Q4_1.gguf" in done.stderr  # the progress line
