"""The GPU check: CUDA tests, then a short benchmark, then one summary table (<= 8 minutes).

Run through `scripts/gpu-check` (which installs the carried wheels first):

1. environment: python, torch, CUDA device, whether ucxx imports;
2. `pytest -m cuda` over CUDA_TEST_FILES: parity with transformers on CUDA (fp32 token-exact,
   bf16 logits close + greedy agreement), P/D with a prefill and a decode process on the GPU
   (which UCX transport moved the KV), seeded sampling P/D vs colocated, CUDA graphs on vs off;
   the tests' reported facts (tests/cuda_facts.py) land in the summary;
3. scripts/gpu_bench.py: copy and KV-push bandwidth, TTFT breakdown, decode tokens/s;
4. one table: every check, its result and its target. JSON and logs go to --out.

`--dry-run` (CPU, CI via tests/test_gpu_check.py) checks that the wheel list parses (and, where
.whl/ exists, that each entry has exactly one wheel and all fit the 64 MiB travel limit with the
tree), every named test file exists, `pytest --collect-only -m cuda` finds exactly the tests of
those files, and the benchmark's plan builds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "scripts" / "gpu-wheels.txt"
CUDA_TEST_FILES = (
    "tests/test_cuda_parity.py",
    "tests/test_cuda_graphs.py",
    "tests/test_cuda_pd.py",
)
TRAVEL_LIMIT = 64 * 2**20  # the device tool's limit on the tree plus carried wheels
TESTS_TIMEOUT = 250  # seconds; with the benchmark's budget the whole check stays <= 8 minutes
BENCH_BUDGET = 150
BENCH_GRACE = 45  # past its own budget, the benchmark is killed


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- wheels -----------------------------------------------------------------------------------
def parse_wheel_list(path: Path = WHEEL_LIST) -> list[tuple[str, str]]:
    """(normalized name, version) per `name==version` line; comments and blanks skipped."""
    out: list[tuple[str, str]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!_-]*)", line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: expected name==version, got {line!r}")
        out.append((normalize(m[1]), m[2]))
    names = [name for name, _ in out]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise ValueError(f"{path.name}: listed twice: {dupes}")
    return out


def wheel_name_version(filename: str) -> tuple[str, str]:
    """PEP 427: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"not a wheel file name: {filename}")
    return normalize(parts[0]), parts[1]


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what the device tool sends: tracked plus untracked-not-ignored files."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file()
    )


def check_wheels(folder: Path) -> tuple[list[str], list[str]]:
    """(problems, notes) for the list against the wheels in `folder` (if it exists)."""
    try:
        wanted = dict(parse_wheel_list())
    except ValueError as e:
        return [str(e)], []
    if not folder.is_dir():
        return [], [f"{len(wanted)} wheels listed; {folder} absent (run scripts/gpu-wheels)"]
    problems: list[str] = []
    found: dict[str, list[tuple[str, Path]]] = {}
    for whl in sorted(folder.glob("*.whl")):
        name, version = wheel_name_version(whl.name)
        found.setdefault(name, []).append((version, whl))
    for name, version in wanted.items():
        have = found.get(name, [])
        if len(have) != 1:
            problems.append(f"{name}=={version}: {len(have)} wheels in {folder} (want one)")
        elif have[0][0] != version:
            problems.append(f"{name}: wheel is {have[0][0]}, list says {version}")
    problems += [f"{n}: wheel in {folder} but not in the list" for n in found if n not in wanted]
    size = sum(w.stat().st_size for have in found.values() for _, w in have)
    tree = tree_bytes()
    if size + tree > TRAVEL_LIMIT:
        problems.append(f"wheels {size / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB > 64 MiB")
    notes = [f"{len(wanted)} wheels, {size / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB"]
    return problems, notes


def run_in_tree(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`cmd` from the repository root, importing this tree's code, its output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


# ---- tests ------------------------------------------------------------------------------------
def collect_cuda_tests(python: str, paths: list[str]) -> list[str]:
    # --assert=plain: collecting runs no assertion, and rewriting every module's asserts was
    # most of the collection's time
    pytest = ["-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    pytest += ["--assert=plain"]
    out = run_in_tree([python, *pytest, *paths], timeout=300)
    if out.returncode != 0:
        raise RuntimeError(
            f"pytest --collect-only failed ({out.returncode}):\n{out.stdout[-2000:]}"
        )
    return [line for line in out.stdout.splitlines() if "::" in line]


def check_tests(python: str) -> tuple[list[str], list[str]]:
    missing = [f for f in CUDA_TEST_FILES if not (ROOT / f).is_file()]
    if missing:
        return [f"test file missing: {f}" for f in missing], []
    problems: list[str] = []
    # the two collections are independent processes: side by side, the slower one's time
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(collect_cuda_tests, python, ["tests"])
        listed = pool.submit(collect_cuda_tests, python, list(CUDA_TEST_FILES))
        everywhere, selected = whole.result(), listed.result()
    files = {node.split("::", 1)[0] for node in everywhere}
    problems += [
        f"cuda tests outside the check's list: {f}" for f in sorted(files - set(CUDA_TEST_FILES))
    ]
    problems += [f"no cuda-marked test in {f}" for f in CUDA_TEST_FILES if f not in files]
    if sorted(selected) != sorted(n for n in everywhere if n.split("::")[0] in CUDA_TEST_FILES):
        problems.append("collecting the listed files selects other tests than the whole tree")
    return problems, [f"{len(selected)} cuda tests in {len(CUDA_TEST_FILES)} files"]


def check_bench(python: str) -> tuple[list[str], list[str]]:
    out = run_in_tree([python, str(ROOT / "scripts" / "gpu_bench.py"), "--dry-run"], timeout=120)
    if out.returncode != 0:
        return [f"gpu_bench.py --dry-run failed:\n{out.stdout[-1500:]}{out.stderr[-1500:]}"], []
    return [], [out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "bench plan ok"]


def dry_run(args: argparse.Namespace) -> int:
    checks = {"wheels": lambda: check_wheels(Path(args.wheels))}
    if args.only in ("all", "tests"):
        checks["tests"] = lambda: check_tests(sys.executable)
        checks["bench"] = lambda: check_bench(sys.executable)
    failed = False
    with ThreadPoolExecutor(len(checks)) as pool:  # independent: run side by side
        results = {name: pool.submit(check) for name, check in checks.items()}
    for name, result in results.items():
        problems, notes = result.result()
        for note in notes:
            print(f"dry-run {name}: {note}")
        for problem in problems:
            print(f"dry-run {name}: PROBLEM {problem}")
        failed |= bool(problems)
    print("dry-run: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


# ---- the real run -----------------------------------------------------------------------------
def environment() -> dict[str, object]:
    code = (
        "import json, sys, torch\n"
        "env = {'python': sys.version.split()[0], 'torch': torch.__version__,\n"
        "       'cuda': torch.cuda.is_available()}\n"
        "if env['cuda']:\n"
        "    env['device'] = torch.cuda.get_device_name()\n"
        "try:\n"
        "    import ucxx; env['ucxx'] = ucxx.__version__\n"
        "except Exception as e:\n"
        "    env['ucxx'] = f'import failed: {e!r}'\n"
        "print(json.dumps(env))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return {"error": out.stderr[-1000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _default_sigint() -> None:
    """In the child: SIGINT back to its default. A shell runs background jobs with SIGINT
    ignored and the child inherits that, so Python would install no KeyboardInterrupt handler
    and the deadline's SIGINT would do nothing (found running CI under `nohup ... &`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_with_deadline(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> int | str:
    """Run to completion or `timeout`; then SIGINT (pytest and asyncio unwind, so the node
    processes they started, in sessions of their own, are stopped by their finally blocks),
    and SIGKILL 30 s later. Returns the exit status or what happened."""
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint
        )
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return f"timed out after {timeout:.0f}s"


def run_tests(out: Path, facts: Path, timeout: float) -> list[tuple[str, str]]:
    """(test id, outcome) per test; one row 'pytest' with the exit status if it crashed."""
    junit = out / "cuda_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *CUDA_TEST_FILES,
    ]
    env = {**os.environ, "PDSERVE_GPU_FACTS": str(facts)}
    code = run_with_deadline(cmd, out / "cuda_tests.log", env, timeout)
    rows: list[tuple[str, str]] = []
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = f"{tag}: {(el.get('message') or '')[:90]}"
            rows.append(
                (f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", outcome)
            )
    if code != 0:
        rows.append(("pytest exit status", str(code)))
    return rows


def run_bench(out: Path, budget: float) -> list[list[str]]:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_bench.py"),
        "--out",
        str(out),
        "--budget",
        str(budget),
    ]
    # on a time-out, whatever the benchmark wrote so far is in its JSON
    run_with_deadline(cmd, out / "gpu_bench.log", dict(os.environ), budget + BENCH_GRACE)
    result = out / "gpu_bench.json"
    if not result.is_file():
        return [["benchmark", "no gpu_bench.json (see gpu_bench.log)", "", "FAIL"]]
    return json.loads(result.read_text()).get("summary", [])


def read_facts(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        rows.append(
            (
                item["key"],
                json.dumps(item["value"]) if not isinstance(item["value"], str) else item["value"],
            )
        )
    return rows


def print_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(lines)
    print(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check consistency only (CPU)")
    p.add_argument("--only", choices=["all", "wheels", "tests"], default="all", help="dry run")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels folder")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--tests-timeout", type=float, default=TESTS_TIMEOUT, help="seconds")
    p.add_argument("--bench-budget", type=float, default=BENCH_BUDGET, help="seconds")
    args = p.parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = out / "cuda_facts.jsonl"
    facts.unlink(missing_ok=True)
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    rows = [["check", "result", "target", "ok"]]
    rows += [[f"env {k}", str(v), "", ""] for k, v in env.items()]
    if env.get("cuda") is not True or "failed" in str(env.get("ucxx", "failed")):
        rows.append(["env usable", "no CUDA device or no ucxx", "CUDA + ucxx", "FAIL"])
    tests = run_tests(out, facts, args.tests_timeout)
    rows += [
        [f"test {name}", outcome, "passed", "ok" if outcome == "passed" else "FAIL"]
        for name, outcome in tests
    ]
    rows += [[f"fact {k}", v, "reported", ""] for k, v in read_facts(facts)]
    if not args.skip_bench:
        rows += [[str(c) for c in row] for row in run_bench(out, args.bench_budget)]
    rows.append(["wall time", f"{time.monotonic() - started:.0f} s", "<= 480 s", ""])
    (out / "summary.md").write_text(print_table(rows) + "\n")
    return 0 if all(r[3] != "FAIL" for r in rows[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
