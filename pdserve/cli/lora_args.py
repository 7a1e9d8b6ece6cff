"""The LoRA flags (vLLM's names): the adapters a node serves beside its base model."""

from __future__ import annotations

import argparse


def lora_module(text: str) -> tuple[str, str]:
    """`NAME=PATH` (a PEFT adapter directory) as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text!r}: expected NAME=PATH (a PEFT adapter directory or GGUF file)"
        )
    return name, path


def lora_module_text(module: tuple[str, str]) -> str:
    return f"{module[0]}={module[1]}"


def lora_args(g: argparse._ArgumentGroup) -> list[argparse.Action]:
    add = g.add_argument
    return [
        add(
            "--lora-modules",
            nargs="+",
            type=lora_module,
            default=[],
            metavar="NAME=PATH",
            help="LoRA adapters (PEFT directories, or llama.cpp's GGUF adapter files) served "
            "beside the base model; a request names one as its model. Give every node the same",
        ),
        add(
            "--max-loras",
            type=int,
            default=0,
            help="adapter slots on the device (0: as many as --lora-modules); adapters of "
            "different slots share a batch",
        ),
        add("--max-lora-rank", type=int, default=16, help="the largest adapter rank served"),
        add(
            "--allow-runtime-lora",
            action="store_true",
            help="load and unload adapters while serving: a decode or colocated node serves "
            "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key when one "
            "is set) and passes each update on to its prefill nodes, which take it with this "
            "flag too; paths are on each node's own disk, slots --max-loras",
        ),
    ]
