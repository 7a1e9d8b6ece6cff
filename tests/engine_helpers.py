"""Reference outputs from transformers and prompt sets shared by the engine and P/D tests."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

from shared.engine.core import EngineCore
from shared.kv.pool import allocate_kv_pool
from shared.model.cuda_graph_runner import DecodeGraphRunner, engine_decode_runner


def random_prompts(
    n: int,
    vocab: int,
    *,
    min_len: int = 1,
    max_len: int = 300,
    seed: int = 0,
    prefix: list[int] | None = None,
) -> list[list[int]]:
    rng = random.Random(seed)
    lo = 3  # keep clear of special tokens at the bottom of the vocab
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([*(prefix or []), *(rng.randrange(lo, vocab) for _ in range(length))])
    return prompts


def random_max_tokens(n: int, *, lo: int = 1, hi: int = 64, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


@cache
def _hf_model(path: str):
    from tests.support.checkpoints import load_hf_model

    return load_hf_model(Path(path))


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    """transformers `generate(do_sample=False)` for one prompt: the token-exact reference."""
    return hf_greedy_with(_hf_model(str(path)), prompt, max_new_tokens, **kwargs)


def hf_greedy_with(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, **kwargs: object
) -> list[int]:
    """`hf_greedy` on a model already loaded (on its own device); `kwargs` go to `generate`."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """`threads` intra-op threads for the block; restores the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_torch_thread() -> contextlib.AbstractContextManager[None]:
    """One intra-op thread for the block: the tiny test models run one op per microsecond, and on
    a shared few-core machine several processes' OpenMP pools spinning against each other made
    each op ~30x slower."""
    return torch_threads(1)


# a ChatML template, for tiny test checkpoints that have none of their own
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_checkpoint(src: Path, dest: Path) -> Path:
    """A copy of the checkpoint at `src` in `dest`, with a tokenizer config that names the
    benchmark tokenizer's bos/eos tokens and CHATML as its chat template."""
    import json
    import shutil

    from tests.support.checkpoints import BOS_TOKEN, EOS_TOKEN

    shutil.copytree(src, dest)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "chat_template": CHATML,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def pad_decode_steps(core: EngineCore, num_blocks: int) -> DecodeGraphRunner:
    """Send `core`'s decode steps through the CUDA-graph runner eagerly (what CUDA captures):
    its pool of `num_blocks` gets the scratch block after them, which the padding rows write."""
    core.runner.kv_pool = allocate_kv_pool(core.layout, num_blocks + 1, "cpu")
    runner = engine_decode_runner(
        core.model,
        core.kv_pool,
        max_batch_size=core.config.max_batch_size,
        max_model_len=core.max_model_len,
        block_size=core.config.block_size,
        dummy_slot_row=core.sampler.dummy_slot_row,
        scratch_block=num_blocks,
        use_graphs=False,
    )
    core.runner.decode_runner = runner
    return runner
