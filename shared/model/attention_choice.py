"""Which attention path runs prefill and decode on this machine, chosen by timing them.

The fastest path differs by CPU (AVX2, AVX-512, AVX-512 BF16, AMX, Arm) and by shape, and the
machine a kernel is written on is not the one it serves on, so a table of CPU flags cannot
choose. At a node's first start each candidate path is timed on the model's own shapes:

* `native`: the C kernels reading the paged pool (shared/model/paged_prefill.py,
  paged_decode.py), where this machine built and loaded them;
* `sdpa`: torch's `F.scaled_dot_product_attention` (flash on CPU) over this step's K/V, or over
  the sequence's K/V gathered from its blocks;
* `torch`: the eager formula (matmul, softmax, matmul), transformers' reference.

The fastest of each kind is cached in a JSON file (`$PDSERVE_ATTENTION_CACHE`, default
`~/.cache/pdserve/attention_choice.json`; bounded in bytes, oldest entries dropped first) under a
key of the CPU model name, torch version, dtype and shapes, so a later start reuses it without
timing. `PDSERVE_ATTENTION=native|sdpa|torch` forces a path for both kinds (nothing is timed);
`native` falls back to `sdpa` where its kernel does not cover a shape. The start-up log and
/version say what was chosen and the times it was chosen by. With nothing chosen (a library
caller, a test) the default is `native` where it runs, else `sdpa`: the engine's behaviour
before any measurement.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shared.model import native

log = logging.getLogger(__name__)

PATHS = ("native", "sdpa", "torch")
KINDS = ("prefill", "decode")
FORCE_ENV = "PDSERVE_ATTENTION"
CACHE_ENV = "PDSERVE_ATTENTION_CACHE"
CACHE_MAX_BYTES = 256 * 1024  # a few hundred entries: one per model shape, dtype and torch
DEFAULT = "native"

Timer = Callable[[Callable[[], object]], float]


@dataclass(frozen=True)
class Shapes:
    """What the timing runs: the model's attention shapes and a representative workload."""

    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefill_tokens: int
    decode_batch: int
    decode_context: int


@dataclass(frozen=True)
class Choice:
    """The path for each kind, the best seconds of each candidate timed, and where it came
    from ("measured", "cache", or the forcing variable)."""

    paths: dict[str, str]
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = "default"
    key: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        parts = []
        for kind in KINDS:
            timed = self.seconds.get(kind, {})
            times = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in timed.items())
            parts.append(f"{kind} {self.paths[kind]}" + (f" ({times})" if times else ""))
        return "; ".join(parts) + f" [{self.source}]"


_choice: Choice | None = None


def forced() -> str | None:
    """`$PDSERVE_ATTENTION`'s path, None where unset; a value outside PATHS raises ValueError."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if not value:
        return None
    if value not in PATHS:
        raise ValueError(f"{FORCE_ENV}={value!r}: expected one of {', '.join(PATHS)}")
    return value


def path(kind: str) -> str:
    """The path `kind` ("prefill" or "decode") attention takes now."""
    return forced() or (_choice.paths[kind] if _choice is not None else DEFAULT)


def current() -> Choice:
    """The choice in force, for /version and the start-up log."""
    force = forced()
    if force is not None:
        return Choice(dict.fromkeys(KINDS, force), source=FORCE_ENV)
    return _choice or Choice(dict.fromkeys(KINDS, DEFAULT))


def set_choice(choice: Choice | None) -> None:
    global _choice
    _choice = choice


def cpu_model() -> str:
    """/proc/cpuinfo's model name (Arm: its CPU part), '' where there is none."""
    for name in ("model name", "CPU part"):
        line = native._cpuinfo_field(name)
        if ":" in line:
            return line.split(":", 1)[1].strip()
    return ""


def cache_key(shapes: Shapes, cpu: str | None = None, torch_version: str | None = None) -> str:
    cpu = cpu_model() if cpu is None else cpu
    version = torch.__version__ if torch_version is None else torch_version
    fields = [f"{k}={v}" for k, v in asdict(shapes).items()]
    return "|".join([f"cpu={cpu}", f"torch={version}", *fields])


def cache_path() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "attention_choice.json"
    return Path(os.environ.get(CACHE_ENV, default))


def best_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    """The fastest of `reps` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def choose(
    candidates: dict[str, Callable[[], object]], timer: Timer
) -> tuple[str, dict[str, float]]:
    """The fastest candidate by `timer`, and every candidate's seconds."""
    seconds = {name: timer(fn) for name, fn in candidates.items()}
    return min(seconds, key=seconds.__getitem__), seconds


def load_cached(key: str, file: Path) -> Choice | None:
    """The choice stored under `key` in `file`, None where there is none or the file is
    unreadable (it is then rewritten on the next store)."""
    entry = _read(file).get(key)
    if not isinstance(entry, dict):
        return None
    paths, seconds = entry.get("paths"), entry.get("seconds", {})
    if not isinstance(paths, dict) or any(paths.get(k) not in PATHS for k in KINDS):
        return None
    return Choice({k: paths[k] for k in KINDS}, seconds, "cache", key)


def store(choice: Choice, file: Path, max_bytes: int = CACHE_MAX_BYTES) -> None:
    """Add `choice` under its key, dropping the oldest entries while the file would exceed
    `max_bytes`; written to a temporary file and renamed, so a reader never sees half of it."""
    entries = _read(file)
    entries.pop(choice.key, None)
    entries[choice.key] = {"paths": choice.paths, "seconds": choice.seconds}
    text = json.dumps(entries, indent=1)
    while len(text.encode()) > max_bytes and len(entries) > 1:
        entries.pop(next(iter(entries)))  # dicts keep insertion order: the oldest first
        text = json.dumps(entries, indent=1)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(file)
    except OSError as e:
        log.warning("attention choice not cached (%s): it is timed again at the next start", e)


def _read(file: Path) -> dict[str, object]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def establish(
    shapes: Shapes,
    candidates: Callable[[str], dict[str, Callable[[], object]]],
    timer: Timer = best_seconds,
    file: Path | None = None,
) -> Choice:
    """The choice for `shapes`: forced, cached, or timed now (`candidates(kind)`: each path
    that runs `kind` here, as a callable to time) and cached; put in force and logged."""
    force = forced()
    if force is not None:
        choice = current()
    else:
        file = cache_path() if file is None else file
        key = cache_key(shapes)
        cached = load_cached(key, file)
        if cached is not None:
            choice = cached
        else:
            start = time.monotonic()
            timed = {kind: choose(candidates(kind), timer) for kind in KINDS}
            paths = {kind: best for kind, (best, _) in timed.items()}
            seconds = {kind: s for kind, (_, s) in timed.items()}
            choice = Choice(paths, seconds, "measured", key)
            store(choice, file)
            log.info("attention paths timed in %.1fs, cached in %s", time.monotonic() - start, file)
        set_choice(choice)
    log.info("attention: %s", choice.describe())
    return choice
