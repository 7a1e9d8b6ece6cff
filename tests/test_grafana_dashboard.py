"""deploy/grafana/pdserve.json and the autoscaling examples query what the nodes export: every
metric their PromQL names is on the /metrics page of a running node of the tier it selects
(prefill, decode, proxy: one request through them first), with the labels and label values
the query matches on."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import generate
from pdserve.cluster import Cluster
from pdserve.proxy import Proxy

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
AUTOSCALING = ROOT / "deploy" / "kubernetes" / "overlays" / "autoscaling"
TIERS = ("prefill", "decode", "proxy")
# labels Prometheus adds to every series it scrapes (deploy/prometheus, the PodMonitor)
TARGET_LABELS = {"tier", "instance", "job", "node", "namespace", "pod"}
METRIC = re.compile(r"\b(pdserve_[a-zA-Z0-9_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")

# sample name -> {label name -> values seen}
Scrape = dict[str, dict[str, set[str]]]


def parse_scrape(text: str) -> Scrape:
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for key, value in sample.labels.items():
                labels.setdefault(key, set()).add(value)
    return out


def fetch(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_scrape(resp.read().decode())


async def _through_proxy(decode: str, decode_http: int) -> Scrape:
    """One gRPC and one HTTP request through a proxy in front of `decode`; its scrape."""
    proxy = Proxy([decode], health_interval=0.2)
    await proxy.start("127.0.0.1", 0, metrics_port=0, http_port=0, backend_http_port=decode_http)
    try:
        deadline = time.monotonic() + 60
        while not all(r.healthy and r.connected for r in proxy.pool.replicas):
            assert time.monotonic() < deadline, "the proxy never saw the decode node healthy"
            await asyncio.sleep(0.1)
        result = await generate(f"127.0.0.1:{proxy.port}", "Hello there", max_tokens=4, timeout=60)
        assert result.token_ids
        assert proxy.http_server is not None and proxy.metrics_server is not None
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
            url = f"http://127.0.0.1:{proxy.http_server.port}/v1/completions"
            await client.post(url, json=body)
        return await asyncio.to_thread(fetch, proxy.metrics_server.port)
    finally:
        await proxy.stop(1.0)


@pytest.fixture(scope="module")
def scrapes() -> Iterator[dict[str, Scrape]]:
    """{tier: its scrape}, after a request that was prefilled remotely (KV over UCX)."""
    no_local_prefill = ["--local-prefill-tokens", "0", "--local-prefill-idle-tokens", "0"]
    cluster = Cluster("tiny", 1, 1, 0, [], http_port=0, decode_extra=no_local_prefill)
    try:
        (decode,) = cluster.start(timeout=180, echo=False)
        decode_node = next(n for n in cluster.nodes if n.role == "decode")
        decode_http = int(str(decode_node.info["http_port"]))
        out = {"proxy": asyncio.run(_through_proxy(decode, decode_http))}
        for node in cluster.nodes:
            out[node.role] = fetch(int(str(node.info["metrics_port"])))
        yield out
    finally:
        assert cluster.stop() == 0, "a node exited non-zero"


def queries() -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every query in the dashboard and the autoscaling examples."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            out.append((f"${variable['name']}", variable["query"]["query"], ""))
    keda = yaml.safe_load((AUTOSCALING / "keda-scaledobject.yaml").read_text())
    for trigger in keda["spec"]["triggers"]:
        out.append(("KEDA", trigger["metadata"]["query"], ""))
    adapter = yaml.safe_load((AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())
    for rule in adapter["rules"]:
        for key in ("seriesQuery", "metricsQuery"):
            out.append(("prometheus-adapter", re.sub(r",?<<[^>]*>>", "", rule[key]), ""))
    return out


def tiers_selected(matchers: list[tuple[str, str, str]]) -> list[str]:
    for label, op, value in matchers:
        if label == "tier":
            return [value] if op == "=" else [t for t in TIERS if re.fullmatch(value, t)]
    return []


def check_query(expr: str, legend: str, scrapes: dict[str, Scrape]) -> list[str]:
    """What in `expr` no node exports: metric names, label names, label values."""
    problems, labels_in_play = [], set(TARGET_LABELS) | {"le"}
    found = METRIC.findall(expr)
    if not found:
        problems.append("names no pdserve metric")
    for name, selector in found:
        matchers = MATCHER.findall(selector)
        tiers = tiers_selected(matchers) or [t for t in TIERS if name in scrapes[t]]
        if not tiers or any(name not in scrapes[t] for t in tiers):
            problems.append(f"{name} is not exported by {tiers or 'any node'}")
            continue
        exported = scrapes[tiers[0]][name]
        labels_in_play |= set(exported)
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            if label not in exported:
                problems.append(f"{name} has no label {label!r}")
            elif op == "=" and value not in exported[label]:
                problems.append(f"{name}{{{label}}} is never {value!r}: {sorted(exported[label])}")
    grouped = {g.strip() for by in GROUPING.findall(expr) for g in by.split(",") if g.strip()}
    for label in (grouped | set(LEGEND.findall(legend))) - labels_in_play:
        problems.append(f"groups or labels by {label!r}, which none of its metrics has")
    return problems


def test_every_query_names_exported_metrics_and_labels(scrapes: dict[str, Scrape]) -> None:
    problems = [
        f"{where}: {expr}\n    {problem}"
        for where, expr, legend in queries()
        for problem in check_query(expr, legend, scrapes)
    ]
    assert not problems, "\n".join(problems)


def test_the_request_went_through_every_plane(scrapes: dict[str, Scrape]) -> None:
    """The scrapes the check above relies on saw real traffic: a proxied call, a remote
    prefill, KV bytes over UCX."""
    assert "OK" in scrapes["proxy"]["pdserve_proxy_calls_total"]["code"]
    assert "remote" in scrapes["decode"]["pdserve_prefills_total"]["where"]
    for tier in ("prefill", "decode"):
        assert "pdserve_kv_transfer_bytes_total" in scrapes[tier]


def test_the_checker_catches_what_no_node_exports(scrapes: dict[str, Scrape]) -> None:
    bad = {
        "rate(pdserve_no_such_metric_total[5m])": "not exported",
        'pdserve_requests{tier="decode",state="WAITING"}': "never 'WAITING'",
        'pdserve_seats_in_use{tier="decode",phase="x"}': "no label 'phase'",
        'pdserve_kv_transfers_expired_total{tier="decode"}': "not exported by ['decode']",
        "sum by (color) (pdserve_seats_total)": "by 'color'",
    }
    for expr, why in bad.items():
        problems = check_query(expr, "", scrapes)
        assert any(why in p for p in problems), (expr, problems)


def test_compose_scrape_config_finds_every_service_on_its_metrics_port() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    tiers = set()
    for job in config["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]
        (service,) = sd["names"]
        assert sd["port"] == int(services[service]["environment"]["PDSERVE_METRICS_PORT"])
        (relabel,) = job["relabel_configs"]
        assert relabel == {"target_label": "tier", "replacement": service}
        tiers.add(service)
    assert tiers == set(TIERS)


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used - variables)
