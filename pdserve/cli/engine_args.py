"""The engine flags every node command takes, and `pdserve up` passes on to the nodes it
starts."""

from __future__ import annotations

import argparse

from pdserve.cli.lora_args import lora_args, lora_module_text
from pdserve.cli.offload_args import offload_args
from pdserve.log_level import log_level_arg
from shared.serving import tracing


def engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Adds the engine flags to `p`; returns them."""
    g = p.add_argument_group("engine")
    add = g.add_argument
    return [
        add(
            "--model",
            default="tiny",
            help="'tiny', 'smollm2' (built in), a GGUF file or a local Hugging Face directory",
        ),
        *_pool_args(g),
        *offload_args(g),
        *lora_args(g),
        add("--max-batch-size", type=int, default=32),
        add(
            "--max-num-tokens",
            type=int,
            default=0,
            help="per-step token budget (chunked prefill); 0: the role's default, 8192 on a "
            "prefill node (no decode steps to protect: a prompt that long is one chunk), 512 "
            "elsewhere",
        ),
        add(
            "--max-model-len",
            type=int,
            default=0,
            help="0: the smaller of the model's context and what one request can hold in the KV "
            "pool; a longer one than the pool holds is refused at start-up",
        ),
        add(
            "--speculative-config",
            default="",
            metavar="JSON",
            help='speculative decoding, as vLLM spells it: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or '
            '{"method": "draft_model", "model": SPEC, "num_speculative_tokens": 4} (a smaller '
            "model with the same tokenizer; decode and colocated nodes, a prefill node "
            "ignores it)",
        ),
        add("--no-prefix-caching", action="store_true"),
        add("--device", default="auto"),
        add(
            "--dtype",
            default="auto",
            help="auto (bf16 on CUDA and on CPUs with AMX / AVX-512 BF16, else float32), "
            "float32, bfloat16 or float16",
        ),
        add(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="decode steps through CUDA graphs (CUDA only; ignored on CPU)",
        ),
        log_level_arg(g),
        tracing.endpoint_arg(g),
    ]


def _pool_args(g: argparse._ArgumentGroup) -> list[argparse.Action]:
    """How the KV pool is sized: exactly (blocks, MiB) or as a share of free memory."""
    add = g.add_argument
    return [
        add("--block-size", type=int, default=16),
        add(
            "--num-kv-blocks",
            type=int,
            default=0,
            help="the KV pool's size in blocks, exactly; 0: from --kv-cache-mb",
        ),
        add(
            "--kv-cache-mb",
            type=int,
            default=0,
            help="the KV pool's size in MiB, exactly; 0: from --kv-cache-memory-fraction",
        ),
        add(
            "--kv-cache-memory-fraction",
            type=float,
            default=0.0,
            help="share of the memory free once the weights are loaded that the KV pool takes "
            "(CPU: the cgroup's headroom or MemAvailable, whichever is less; CUDA: the device's "
            "free memory); 0: 0.1 on CPU, where a local cluster's nodes share the machine, 0.9 "
            "on CUDA",
        ),
    ]


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags `a` holds away from their defaults (but --model, which the caller
    passes itself), written back as command-line arguments: what `pdserve up` gives each
    node it starts."""
    argv: list[str] = []
    for action in engine_args(argparse.ArgumentParser(add_help=False)):
        value = getattr(a, action.dest)
        if action.dest == "model" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            argv.append(action.option_strings[0])
        elif action.dest == "lora_modules":
            argv += [action.option_strings[0], *map(lora_module_text, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv
