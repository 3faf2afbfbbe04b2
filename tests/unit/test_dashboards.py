"""The Grafana dashboard and the Prometheus alert rules (deploy/) query only what the services export: every metric
in every PromQL expression is a sample name of the real metric classes' exposition (so renaming a metric fails
here), and every label an expression filters or groups by is one that metric carries, or one Prometheus adds."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.flags import DEFAULT_METRICS_PORT
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.router import Route
from tandem.services.metrics import EngineMetrics
from tandem.shared.engine_stats import EngineStats, StepStats
from tandem.shared.cluster_state.registry import InstanceInfo

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((REPO / "deploy/grafana/tandem-dashboard.json").read_text())
PROMETHEUS_YML = REPO / "deploy/prometheus/prometheus.yml"
PROMETHEUS = yaml.safe_load(PROMETHEUS_YML.read_text())
ALERTS = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())

TARGET_LABELS = {"job", "instance"}  # Prometheus adds them to every series it scrapes
PROMETHEUS_SERIES = {"up": TARGET_LABELS | {"tier"}}  # its own series per target (tier: prometheus.yml's relabeling)
METRIC = re.compile(r"(?<![\w:])(tandem:[A-Za-z0-9_:]+|up)(?![\w:])")
SELECTOR = re.compile(r"(?<![\w:])(tandem:[A-Za-z0-9_:]+|up)\{([^}]*)\}")
AGGREGATION = re.compile(r"\b(?:sum|avg|min|max|count) by \(([^)]*)\) \(")


def exported_samples() -> dict[str, set[str]]:
    """{sample name: its label names} over the exposition of both engine tiers and the gateway, each metric
    observed once (labelled metrics export nothing before their first observation)."""
    registries = []
    for tier in ("prefill", "decode"):
        engine = EngineMetrics(tier, "m", f"{tier}-1")
        engine.stats.stats = EngineStats(model_id="m", block_size=16, num_blocks=64, num_free_blocks=60,
                                         num_running=1, num_waiting=1)  # fmt: skip
        engine.observe_step(StepStats(duration_s=0.01, num_requests=1, num_tokens=8, queue_times_s=[0.002]))
        engine.observe_kv_message("decode-a", 4096)
        engine.kv_transfer_duration.labels(**engine.labels, peer="decode-a").observe(0.01)
        registries.append(engine.registry)
    gateway = GatewayMetrics("m", "gateway-1")
    decode, prefill = (InstanceInfo(f"{t}-a", t, "10.0.0.2:50061", "m", 16) for t in ("decode", "prefill"))
    gateway.observe_route(Route(decode=decode, prefill=prefill, prefill_cached_tokens=16))
    gateway.observe_tokens(2, 0.02)
    gateway.observe_finished("stop", num_prompt=20, num_cached=16, num_generated=3, ttft_s=0.1, e2e_s=0.2)
    gateway.observe_error("UNAVAILABLE")
    registries.append(gateway.registry)
    samples: dict[str, set[str]] = {}
    for registry in registries:
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


EXPORTED = exported_samples()
KNOWN = EXPORTED | PROMETHEUS_SERIES


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard query, template variable query and alert rule."""
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in panels() for t in p["targets"]]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            query = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
            found.append((f"variable {variable['name']}", f"count by ({query[2]}) ({query[1]})"))
    found += [(f"alert {r['alert']}", r["expr"]) for g in ALERTS["groups"] for r in g["rules"]]
    return found


def parenthesized(expr: str, start: int) -> str:
    """The text inside the parenthesis opening at expr[start]."""
    depth = 0
    for i in range(start, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[start + 1 : i]
    raise AssertionError(f"unbalanced parentheses: {expr}")


@pytest.mark.parametrize("where, expr", expressions(), ids=[w for w, _ in expressions()])
def test_expression_names_exported_metrics_and_their_labels(where, expr):
    code = " ".join(re.sub(r'"[^"]*"', '""', expr).split())  # label values out, one space between tokens
    names = METRIC.findall(code)
    assert names, f"{where} queries no metric: {expr}"
    unknown = sorted(set(names) - set(KNOWN))
    assert not unknown, f"{where} queries metrics nothing exports: {unknown} (exported: {sorted(EXPORTED)})"
    for name, matchers in SELECTOR.findall(code):
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
        assert labels <= KNOWN[name] | TARGET_LABELS, f"{where}: {name} has no label {labels - KNOWN[name]}"
    aggregations = list(AGGREGATION.finditer(code))
    assert len(aggregations) == len(re.findall(r"\bby\b", code)), f"{where}: write `sum by (...) (...)`: {expr}"
    for match in aggregations:
        grouped = {label.strip() for label in match[1].split(",")}
        for name in METRIC.findall(parenthesized(code, match.end() - 1)):
            missing = grouped - KNOWN[name] - TARGET_LABELS
            assert not missing, f"{where} groups {name} by labels it does not have: {sorted(missing)}"


def test_dashboard_panels_have_queries_unique_ids_and_the_datasource_variable():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "model_name", "instance"} <= variables
    for panel in panels():
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"


def test_dashboard_panels_do_not_overlap():
    cells = {}
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r}"
                cells[x, y] = panel["title"]


def test_alert_rules_are_complete():
    rules = [r for g in ALERTS["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheus_scrapes_every_service_of_the_compose_cluster():
    for path in PROMETHEUS["rule_files"]:
        assert (PROMETHEUS_YML.parent / path).is_file(), path
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    assert set(jobs) == {"gateway", "prefill", "decode"}
    gateway_http_port = COMPOSE["services"]["gateway"]["environment"]["TANDEM_HTTP_PORT"]
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway_http_port}"]
    for tier in ("prefill", "decode"):
        assert COMPOSE["services"][tier]["environment"]["TANDEM_METRICS_PORT"] == DEFAULT_METRICS_PORT
        assert jobs[tier]["dns_sd_configs"] == [{"names": [tier], "type": "A", "port": DEFAULT_METRICS_PORT,
                                                 "refresh_interval": "10s"}]  # fmt: skip
    # honor_labels keeps the exported tier label; it must not let a service override job or instance
    assert all(job["honor_labels"] for job in jobs.values())
    assert not any(labels & TARGET_LABELS for labels in EXPORTED.values())


def test_compose_monitoring_profile_mounts_what_exists():
    services = COMPOSE["services"]
    assert [name for name, s in services.items() if "monitoring" in s.get("profiles", ())] == ["prometheus",
                                                                                                 "grafana"]  # fmt: skip
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            host, container = volume.split(":")[:2]
            assert (REPO / host).exists(), f"{name} mounts missing {host}"
            mounts[container] = host
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/tandem.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert any(c.startswith(folder + "/") and h.endswith(".json") for c, h in mounts.items()), mounts
    datasource = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus' own checker) is not installed")
def test_promtool_accepts_the_config_the_rules_and_every_dashboard_query(tmp_path):
    queries = [{"record": f"panel_{p['id']}_{t['refId']}", "expr": t["expr"].replace("$__rate_interval", "1m")}
               for p in panels() for t in p["targets"]]  # fmt: skip
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": queries}]}))
    for args in (["check", "config", str(PROMETHEUS_YML)], ["check", "rules", str(tmp_path / "dashboard_rules.yml")]):
        run = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
