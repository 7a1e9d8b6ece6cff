"""The two-tier docker-compose deployment, for real: offline image build, 2 prefill + 2 decode
replicas behind the gRPC proxy, the C kernels prebuilt in the image and on in every node (the
image itself without a compiler), greedy parity through the published port, a prefill replica
killed, the prefill tier scaled, and `down` leaving nothing behind.

Opt-in (it builds an image): runs when PDSERVE_DOCKER_TEST=1; `.ci/docker-step` sets it. Skipped,
with the reason, only where Docker cannot run (no docker CLI, or no daemon and none can be
started). If no daemon is running and we are root, the test starts `dockerd` itself and stops it
again at the end (images and build cache stay on disk, so the next run is warm).

Everything is built offline (no registry pulls):
  - base image: debootstrap bookworm + `docker import` (docker/build-base-image.sh);
  - the kernels' build base: the same plus gcc (`build-base-image.sh pdserve-build-base
    gcc,libc6-dev`), used only by the image's stage that compiles the kernels;
  - wheels: `pip download` on the host into docker/wheelhouse (docker/wheelhouse.sh);
  - image: `docker build --build-arg BASE_IMAGE=<that>` installing with --no-index.
Caches live under $PDSERVE_DOCKER_CACHE (default /var/cache/pdserve-docker), keyed by hashes of
their inputs, plus Docker's own layer cache. Phase timings are printed (run pytest with -s).

Knobs: PDSERVE_DOCKER_IMAGE (tag to build, default pdserve:ci), PDSERVE_COMPOSE (compose
command, default `docker-compose` if installed, else `docker compose`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.client import GenerationResult, generate
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.sampling.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.serving.metrics import parse_prometheus_text
from tests.engine_helpers import random_max_tokens, random_prompts

pytestmark = pytest.mark.skipif(
    os.environ.get("PDSERVE_DOCKER_TEST") != "1",
    reason="docker deployment test is opt-in: PDSERVE_DOCKER_TEST=1 (or run .ci/docker-step)",
)

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("PDSERVE_DOCKER_CACHE", "/var/cache/pdserve-docker"))
IMAGE = os.environ.get("PDSERVE_DOCKER_IMAGE", "pdserve:ci")
MODEL_NAME = "qwen2"  # built by tests/support/checkpoints.py, mounted at /models/qwen2


# ----------------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[docker-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"`{shlex.join(cmd)}` exited {proc.returncode}\n--- stdout (tail)\n"
            f"{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"
        )
    return proc


class Phases:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        log(f"{name} ...")
        t = time.monotonic()
        try:
            yield
        finally:
            self.times.append((name, time.monotonic() - t))
            log(f"{name}: {time.monotonic() - t:.1f}s")

    def report(self) -> None:
        rows = ", ".join(f"{n} {s:.0f}s" for n, s in self.times)
        log(f"total {time.monotonic() - self.start:.0f}s ({rows})")


def docker_ok() -> bool:
    try:
        return sh(["docker", "info"], timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def docker_daemon() -> Iterator[None]:
    """A reachable Docker daemon; started here (and stopped after) if none runs and we may."""
    if shutil.which("docker") is None:
        pytest.skip("Docker cannot run here: no docker CLI (apt-get install docker.io)")
    if docker_ok():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip(
            "Docker cannot run here: no daemon is reachable and "
            + ("`dockerd` is not installed" if dockerd is None else "we are not root to start it")
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    log_path = CACHE / "dockerd.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 60
    while not docker_ok():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            proc.wait(30)
            tail = log_path.read_text(errors="replace")[-1500:]
            pytest.skip(f"Docker cannot run here: dockerd did not start:\n{tail}")
        time.sleep(0.5)
    log(f"started dockerd (pid {proc.pid}); it is stopped again after the test")
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def compose_command() -> list[str]:
    if os.environ.get("PDSERVE_COMPOSE"):
        return shlex.split(os.environ["PDSERVE_COMPOSE"])
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if sh(["docker", "compose", "version"], timeout=20, check=False).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("no compose: install docker-compose (1.29) or the docker compose v2 plugin")


def base_image(*args: str) -> str:
    return sh(["docker/build-base-image.sh", *args], timeout=600).stdout.strip().splitlines()[-1]


def build_image() -> None:
    """Base images, wheelhouse and image, all offline and cached."""
    base = base_image()
    build_base = base_image("pdserve-build-base", "gcc,libc6-dev")  # compiles the C kernels
    log(f"base image {base}, kernel build base {build_base}")
    sh(["docker/wheelhouse.sh"], timeout=1200, env={"PYTHON": sys.executable})
    sh(
        [
            "docker",
            "build",
            "-q",
            "--force-rm",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            f"BUILD_BASE_IMAGE={build_base}",
            "-t",
            IMAGE,
            ".",
        ],
        timeout=1500,
        env={"DOCKER_BUILDKIT": "0"},
    )


IMAGE_PYTHON = "/opt/pdserve/bin/python"
IMAGE_KERNELS = "/opt/pdserve/kernels/"
# what a decode node serves on /version, read from inside its container
VERSION = (
    "import urllib.request; print(urllib.request.urlopen("
    "'http://127.0.0.1:8000/version', timeout=10).read().decode())"
)
# every kernel's state as the image's environment resolves it (a prefill node has no /version)
STATES = (
    "import json; from shared.model import native; "
    "print(json.dumps({k: s.as_dict() for k, s in native.states().items()}))"
)


def check_kernels(kernels: dict[str, dict[str, str]], where: str) -> None:
    """Each C kernel on from the image's prebuilt libraries, or off only for this CPU."""
    for name, state in kernels.items():
        ok = (
            state["path"].startswith(IMAGE_KERNELS)
            if state["state"] == "on"
            else state["reason"].startswith("CPU lacks")
        )
        assert ok, f"{where}: kernel {name} {state}"
    assert kernels["fused_ops"]["state"] == kernels["paged_decode"]["state"] == "on", kernels
    states = ", ".join(f"{k} {s.get('variant') or s['reason']}" for k, s in kernels.items())
    log(f"{where}: {states}")


def check_image_kernels(decodes: list[str], prefills: list[str]) -> None:
    """The kernels are prebuilt in the image and on in every node; the image has no compiler."""
    for d in decodes:
        version = sh(["docker", "exec", d, IMAGE_PYTHON, "-c", VERSION], timeout=60).stdout
        check_kernels(json.loads(version)["kernels"], f"decode {d[:12]} /version")
    for p in prefills:
        states = sh(["docker", "exec", p, IMAGE_PYTHON, "-c", STATES], timeout=120).stdout
        check_kernels(json.loads(states), f"prefill {p[:12]}")
        logs = sh(["docker", "logs", p], timeout=60)
        # at the default level only a kernel a person can turn on (a missing library) logs
        assert "C kernel" not in logs.stdout + logs.stderr, logs.stderr[-3000:]
    compiler = ["docker", "exec", decodes[0], "sh", "-c", "command -v cc || command -v gcc"]
    assert sh(compiler, timeout=60, check=False).returncode != 0, "a compiler in the image"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CHAT_CONFIG = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
}
CHAT = [{"role": "user", "content": "Hello from the docker test"}]


def chat_over_http(port: int) -> dict[str, object]:
    """One greedy chat completion through the proxy's published HTTP port."""
    url = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(f"{url}/models", timeout=60) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def make_model_dir(root: Path) -> Path:
    """A small qwen2 checkpoint under root/qwen2, readable by the image's non-root user."""
    from tests.support.checkpoints import build_checkpoint

    build_checkpoint(MODEL_NAME, root / MODEL_NAME)
    # a chat template, for the chat request through the proxy's HTTP port
    (root / MODEL_NAME / "tokenizer_config.json").write_text(json.dumps(CHAT_CONFIG))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root / MODEL_NAME


def colocated_container(model_root: Path, want: str) -> None:
    """`docker run IMAGE colocated ...` as an operator runs one node that serves alone: the
    image's HEALTHCHECK reports it healthy, its HTTP API answers the colocated engine's greedy
    chat, and `docker stop` ends it with exit code 0."""
    port = free_port()
    name = f"pdservetest-colocated-{os.getpid()}"
    model = ["--model", f"/models/{MODEL_NAME}", "--http-port", "8000"]
    volume = f"{model_root}:/models:ro"
    run = ["docker", "run", "-d", "--name", name, "-v", volume, "-p", f"127.0.0.1:{port}:8000"]
    # the reference's dtype (the suite pins `auto` to float32), as the compose file passes it
    dtype = ["-e", f"PDSERVE_AUTO_DTYPE={os.environ.get('PDSERVE_AUTO_DTYPE', '')}"]
    sh([*run, *dtype, IMAGE, "colocated", *model], timeout=120)

    def state(fmt: str) -> str:
        return sh(["docker", "inspect", "-f", fmt, name], timeout=30).stdout.strip()

    try:
        wait_for("colocated container healthy", lambda: state(HEALTH) == "healthy", 240)
        reply = chat_over_http(port)
        assert reply["choices"][0]["message"]["content"] == want, reply  # type: ignore[index]
        sh(["docker", "stop", "--time", "30", name], timeout=90)
        assert state("{{.State.ExitCode}}") == "0", sh(["docker", "logs", name], timeout=30)
    finally:
        sh(["docker", "rm", "-f", name], timeout=60, check=False)


HEALTH = "{{.State.Health.Status}}"


class Stack:
    """One compose project: its containers by service, their ports and metrics."""

    def __init__(self, project: str, env: dict[str, str]):
        self.project = project
        self.env = env
        self.compose = [*compose_command(), "-p", project, "-f", str(REPO / "docker-compose.yml")]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return sh([*self.compose, *args], timeout=timeout, env=self.env)

    def containers(self, service: str, *, all_states: bool = False) -> list[str]:
        out = sh(
            [
                "docker",
                "ps",
                *(["-a"] if all_states else []),
                "-q",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={service}",
            ],
            timeout=30,
        )
        return out.stdout.split()

    def inspect(self, container: str, fmt: str) -> str:
        return sh(["docker", "inspect", "-f", fmt, container], timeout=30).stdout.strip()

    def metrics(self, container: str) -> dict[str, float]:
        port = self.inspect(
            container, '{{(index (index .NetworkSettings.Ports "9100/tcp") 0).HostPort}}'
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return parse_prometheus_text(resp.read().decode())

    def wait_healthy(self, service: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ids = self.containers(service)
            states = [self.inspect(c, "{{.State.Health.Status}}") for c in ids]
            if len(ids) >= count and states.count("healthy") >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{service}: want {count} healthy, have {states}")
            time.sleep(1)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, cmd in (
            ("containers", ["docker", "ps", "-aq", "--filter", label]),
            ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
            ("volumes", ["docker", "volume", "ls", "-q", "--filter", label]),
        ):
            found[kind] = sh(cmd, timeout=30).stdout.split()
        return found


def healthy_prefill_peers(metrics: dict[str, float]) -> int:
    return sum(
        1 for k, v in metrics.items() if k.startswith("pdserve_prefill_peer_healthy{") and v == 1
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(1)


async def generate_all(
    target: str, prompts: list[str | list[int]], max_tokens: list[int]
) -> list[tuple[GenerationResult, float]]:
    """Every request at once; (result, seconds) each."""

    async def one(prompt: str | list[int], n: int) -> tuple[GenerationResult, float]:
        t = time.monotonic()
        result = await generate(target, prompt, max_tokens=n, timeout=120)
        return result, time.monotonic() - t

    return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens, strict=True)))


# -------------------------------------------------------------------------------------- test
def test_two_tier_compose_stack_offline(
    docker_daemon: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    phases = Phases()
    with phases("build (base image, wheelhouse, image)"):
        build_image()

    model_root = tmp_path_factory.mktemp("models")
    model_dir = make_model_dir(model_root)
    # prompts: token ids and one text prompt (through the tokenizer in the mounted checkpoint)
    batches: list[list[str | list[int]]] = [
        [*random_prompts(7, 500, min_len=1, max_len=120, seed=71), "Hello from the docker test"],
        *(list(random_prompts(6, 500, min_len=1, max_len=120, seed=72 + i)) for i in range(3)),
    ]
    max_tokens = [
        random_max_tokens(len(b), lo=1, hi=16, seed=80 + i) for i, b in enumerate(batches)
    ]
    with phases("colocated reference"):
        colocated = LLM(
            EngineConfig(model=str(model_dir), num_kv_blocks=1024), load_model(str(model_dir))
        )
        want = [
            [o.token_ids for o in colocated.generate(b, [SamplingParams(max_tokens=m) for m in mt])]
            for b, mt in zip(batches, max_tokens, strict=True)
        ]
        loaded = load_model(str(model_dir))
        assert loaded.chat_template is not None
        chat_ids = loaded.tokenizer.encode(
            loaded.chat_template.render(CHAT), add_special_tokens=False
        )
        (chat_want,) = colocated.generate([chat_ids], [SamplingParams(max_tokens=8)])

    port, http_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    stack = Stack(
        f"pdservetest{os.getpid()}",
        {
            "PDSERVE_IMAGE": IMAGE,
            "PDSERVE_PORT": str(port),
            "PDSERVE_HTTP_PORT": str(http_port),
            "PDSERVE_BIND": "127.0.0.1",
            "PDSERVE_MODEL_DIR": str(model_root),
            "PDSERVE_MODEL": f"/models/{MODEL_NAME}",
        },
    )

    def check_batch(i: int) -> None:
        results = asyncio.run(generate_all(target, batches[i], max_tokens[i]))
        for j, (r, _) in enumerate(results):
            assert r.token_ids == want[i][j], f"batch {i} request {j}: differs from colocated"
        slowest = max(t for _, t in results)
        log(
            f"batch {i}: {len(results)} requests match the colocated engine; slowest {slowest:.2f}s"
        )
        if slowest > 5:
            log(f"WARNING: batch {i}: a request took {slowest:.1f}s (routed to a dead peer?)")

    def wait_prefill_peers(n: int, timeout: float) -> None:
        for d in decodes:  # each decode replica sees n healthy prefill replicas (DNS + health)
            wait_for(
                f"{n} healthy prefill peers on decode {d[:12]}",
                lambda d=d: healthy_prefill_peers(stack.metrics(d)) == n,
                timeout,
            )

    ok = False
    try:
        with phases("compose up: 2 prefill + 2 decode + proxy"):
            stack.run("up", "-d", "--no-build", "--scale", "prefill=2", "--scale", "decode=2")
            stack.wait_healthy("proxy", 1, timeout=180)
        prefills, decodes = stack.containers("prefill"), stack.containers("decode")
        (proxy,) = stack.containers("proxy")
        assert len(prefills) == 2 and len(decodes) == 2
        wait_prefill_peers(2, 30)
        with phases("C kernels: prebuilt variants on in every node"):
            check_image_kernels(decodes, prefills)

        with phases("greedy Generate through the published port"):
            check_batch(0)
        served = {
            k
            for k, v in stack.metrics(proxy).items()
            if k.startswith("pdserve_proxy_calls_total{") and 'code="OK"' in k and v > 0
        }
        assert len(served) == 2, f"the proxy did not use both decode replicas: {served}"
        with phases("one chat request through the proxy's HTTP port"):
            chat = chat_over_http(http_port)
            assert chat["object"] == "chat.completion", chat
            assert chat["usage"]["prompt_tokens"] == len(chat_ids), chat  # type: ignore[index]
            assert chat["choices"][0]["message"]["content"] == chat_want.text, chat  # type: ignore[index]

        if os.geteuid() == 0:
            with phases("crash a prefill replica (SIGKILL); serving; restart policy"):
                victim = prefills[0]
                pid = int(stack.inspect(victim, "{{.State.Pid}}"))
                os.kill(pid, signal.SIGKILL)  # as the OOM killer would: not a `docker stop`
                wait_for("the replica's process to die", lambda: not pid_alive(pid), 30)
                check_batch(1)
                wait_for(
                    "the restart policy to restart it",
                    lambda: int(stack.inspect(victim, "{{.RestartCount}}")) >= 1,
                    60,
                )
                stack.wait_healthy("prefill", 2, timeout=120)
                wait_prefill_peers(2, 60)
        else:
            log("not root: cannot SIGKILL a container's process; crash phase skipped")

        with phases("remove a prefill replica (docker kill: its address vanishes); serving"):
            sh(["docker", "kill", prefills[1]], timeout=60)  # stays down: a manual stop
            check_batch(2)

        with phases("scale prefill to 3: decode nodes find the new replicas by DNS"):
            stack.run("up", "-d", "--no-build", "--scale", "prefill=3", "--scale", "decode=2")
            stack.wait_healthy("prefill", 3, timeout=180)
            wait_prefill_peers(3, 60)
            check_batch(3)

        with phases("graceful stop (SIGTERM): every node exits 0"):
            stack.run("stop", "--timeout", "30")
            codes = {
                c[:12]: stack.inspect(c, "{{.State.ExitCode}}")
                for s in ("prefill", "decode", "proxy")
                for c in stack.containers(s, all_states=True)
            }
            assert set(codes.values()) == {"0"}, f"exit codes {codes}"
        ok = True
    finally:
        if not ok:
            with contextlib.suppress(Exception):
                logs = stack.run("logs", "--no-color", "--tail", "40", timeout=60)
                log("compose logs (tail):\n" + logs.stdout[-8000:])
        with phases("compose down"):
            stack.run("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300)
    left = stack.leftovers()
    assert left == {"containers": [], "networks": [], "volumes": []}, f"left behind: {left}"
    with phases("colocated container: healthy, answers, stops clean"):
        colocated_container(model_root, chat_want.text)
    phases.report()
