"""Monitoring: the Prometheus configs and rules, the Grafana dashboard, checked with the real tools
and against a live gateway.

    promtool check config    both Prometheus configs, with the rule files they load
    promtool test rules      every alert of deploy/prometheus/rules against input series, with
                             cases that must fire and cases that must not
                             (tests/prometheus/dialspec-alerts.test.yml)
    promtool check rules     every dashboard query is valid PromQL
    a live `dialspec serve`  every `dialspec:` name the dashboard reads is on its /metrics
    a real Prometheus        Debian's server binary, with deploy/prometheus/prometheus.cpu.yml and
                             the rules, scraping a live gateway on 127.0.0.1 every second while
                             traffic reaches every tier: every dashboard query and every PromQL
                             expression of server/gateway/metrics.py's docstring returns data
                             through the HTTP API, and every rule evaluates without error

promtool and prometheus come from `make deploy-tools` (part of `make test`); a missing tool fails
the test with that hint instead of skipping it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.gateway import metrics as gateway_metrics
from tests.deploy_files import (
    COMPOSE_FILES,
    DASHBOARD,
    DEPLOY,
    LISTEN,
    METRIC_RE,
    ROOT,
    as_promql,
    dashboard,
    dashboard_panels,
    dashboard_queries,
    env_example,
    load_yaml,
    start_gateway,
    tool,
)
from tests.fake_sglang import free_port

RULES = DEPLOY / "prometheus" / "rules"
RULE_TESTS = ROOT / "tests" / "prometheus" / "dialspec-alerts.test.yml"


def docstring_promql() -> list[str]:
    """The PromQL expressions of server/gateway/metrics.py's docstring: each entry is a line
    indented 4 and ending with ':', its expression the more-indented lines after it."""
    exprs, current = [], None
    for line in (gateway_metrics.__doc__ or "").splitlines():
        indent = len(line) - len(line.lstrip())
        if current is not None and line.strip() and indent > 4:
            current.append(line.strip())
            continue
        if current:
            exprs.append(" ".join(current))
        current = [] if indent == 4 and line.rstrip().endswith(":") else None
    if current:
        exprs.append(" ".join(current))
    return [e.replace('position="i"', 'position="0"') for e in exprs]


@contextlib.contextmanager
def _gateway(tiny_pair, num_draft: str):
    """`dialspec serve` (embedded, tiny pair) configured from .env.example as the compose files
    configure it; yields (base URL, tier names)."""
    settings_env = env_example()
    # The gateway's settings come from .env.example alone (the test cache dir stays: see conftest).
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIALSPEC_") or k == "DIALSPEC_CACHE_DIR"}
    env.update(
        DIALSPEC_BACKEND="embedded",
        DIALSPEC_TIERS=settings_env["TIERS"],
        DIALSPEC_DEFAULT_QUALITY=settings_env["DEFAULT_QUALITY"],
        DIALSPEC_MAX_WAITING=settings_env["MAX_WAITING"],
    )
    proc, url = start_gateway(*tiny_pair, env, num_draft)
    try:
        yield url, list(json.loads(settings_env["TIERS"]))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def live_gateway(tiny_pair):
    """N fixed at 3, as the compose files fix it (NUM_DRAFT)."""
    with _gateway(tiny_pair, "3") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def adaptive_gateway(tiny_pair):
    """N chosen per round (`dialspec serve`'s default): quality 0 decodes from the draft alone,
    which only such an engine does (dialspec:draft_only_tokens_total)."""
    with _gateway(tiny_pair, "auto") as gateway:
        yield gateway


def drive_traffic(url: str, tiers: list[str]) -> None:
    """One request at every tier, a numeric quality, quality 0 (draft alone), one streamed, and
    one refused (400: dialspec:request_errors_total)."""
    with httpx.Client(base_url=url, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert {f"{model}:{t}" for t in tiers} <= listed, listed
        msg = [{"role": "user", "content": "Tom has 12 apples"}]
        for quality in [*tiers, 0.4, 0.0]:
            r = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": msg, "max_tokens": 8, "seed": 1, "quality": quality},
            )
            assert r.status_code == 200, r.text
        body = {"model": model, "prompt": "Tom has", "max_tokens": 6, "stream": True, "quality": tiers[0]}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        r = http.post(
            "/v1/chat/completions", json={"model": model, "messages": msg, "quality": "no-such-tier"}
        )
        assert r.status_code == 400


# --------------------------------------------------------------------------------------------- prometheus
@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_prometheus_config_passes_promtool(kind):
    config = DEPLOY / "prometheus" / f"prometheus.{kind}.yml"
    out = subprocess.run(
        [tool("promtool"), "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    services = load_yaml(COMPOSE_FILES[kind])["services"]
    targets = {
        job["job_name"]: target
        for job in load_yaml(config)["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert targets["dialspec-gateway"] == "gateway:8000"
    for job, target in targets.items():
        host, port = target.split(":")
        if host == "localhost":
            continue
        assert host in services, f"{job}: no compose service {host}"
        if host == "router":
            assert f'ROUTER_METRICS_PORT: "{port}"' in COMPOSE_FILES[kind].read_text()
        else:
            assert int(port) == LISTEN[host], f"{job}: {target} is not where {host} listens"


def test_dashboard_queries_are_valid_promql(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dialspec_dashboard:query_{i}", "expr": as_promql(expr)}
                    for i, expr in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(
        [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------------------------- grafana
def test_dashboard_panels_and_provisioning():
    dash = dashboard()
    panels = [p for p in dashboard_panels() if p["type"] != "row"]
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"])
    titles = " | ".join(p["title"].lower() for p in panels)
    for needed in (
        "acceptance rate by tier",
        "mean accepted length",
        "per draft position",
        "ensemble weight w (histogram",
        "time to first token",
        "inter-token latency",
        "end-to-end latency",
        "throughput",
        "running and waiting",
    ):
        assert needed in titles, f"missing panel: {needed}"
    queries = "\n".join(dashboard_queries())
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, tier) (rate(dialspec:{hist}_bucket" in queries
    # The tier variable filters the tier-labelled panels.
    assert dash["templating"]["list"][1]["name"] == "tier" and 'tier=~"$tier"' in queries

    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ][0]
    assert datasource["uid"] == dash["templating"]["list"][0]["current"]["value"]
    assert datasource["url"] == "http://prometheus:9090"
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dialspec.yml")["providers"][0]
    for path in COMPOSE_FILES.values():
        grafana = load_yaml(path)["services"]["grafana"]
        mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
        assert mounts["./grafana/dashboards"] == provider["options"]["path"]
        assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
        assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
            provider["options"]["path"] + "/" + DASHBOARD.name
        )


def test_dashboard_metrics_exist_on_a_live_gateway(live_gateway):
    """Every `dialspec:` name the dashboard queries is a series on the real gateway's /metrics,
    with the gateway configured from .env.example the way the compose files configure it."""
    url, tiers = live_gateway
    drive_traffic(url, tiers)
    exposition = httpx.get(url + "/metrics", timeout=60).text
    assert httpx.get(url + "/health").status_code == 200

    series: dict[str, set[tuple]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            series.setdefault(sample.name, set()).add(tuple(sorted(sample.labels.items())))
    used = sorted({m for expr in dashboard_queries() for m in METRIC_RE.findall(expr)})
    assert len(used) >= 15
    missing = [m for m in used if m not in series]
    assert not missing, f"the dashboard queries series the gateway does not export: {missing}"
    # Tier-filtered queries only make sense on tier-labelled series; the tiers of .env.example show up.
    for expr in dashboard_queries():
        if 'tier=~"$tier"' in expr:
            for name in METRIC_RE.findall(expr):
                labels = {k for labelset in series[name] for k, _ in labelset}
                assert "tier" in labels, f"{name} has no tier label"
    seen_tiers = {
        v
        for labelset in series["dialspec:e2e_request_latency_seconds_count"]
        for k, v in labelset
        if k == "tier"
    }
    assert set(tiers) <= seen_tiers
    positions = {
        v
        for labelset in series["dialspec:spec_decode_num_accepted_tokens_per_pos_total"]
        for _, v in labelset
    }
    assert positions and positions <= {"0", "1", "2"}


# --------------------------------------------------------------------------------------------- rules
def test_rules_are_loaded_by_both_compose_stacks():
    for kind, path in COMPOSE_FILES.items():
        config = load_yaml(DEPLOY / "prometheus" / f"prometheus.{kind}.yml")
        assert config["rule_files"] == ["rules/*.yml"], kind  # relative to the config file
        mounts = [v.split(":")[:2] for v in load_yaml(path)["services"]["prometheus"]["volumes"]]
        assert ["./prometheus/rules", "/etc/prometheus/rules"] in mounts, kind
        assert ["./prometheus/prometheus." + kind + ".yml", "/etc/prometheus/prometheus.yml"] in mounts
    assert sorted(p.name for p in RULES.glob("*.yml")) == ["dialspec-alerts.yml"]


def test_alert_rules_pass_their_unit_tests():
    out = subprocess.run(
        [tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    alerts = {
        r["alert"]
        for g in load_yaml(RULES / "dialspec-alerts.yml")["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert alerts - {"DialspecGatewayDown"} and tested == alerts, f"untested alerts: {alerts - tested}"
    # every alert has a case where it must not fire
    silent = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts: \[\]", RULE_TESTS.read_text()))
    assert silent == alerts, f"alerts without a must-not-fire case: {alerts - silent}"


def test_a_broken_rule_fails_the_unit_tests(tmp_path):
    """The unit tests bite: the 5xx threshold raised to 50 % no longer fires on 10 %."""
    (tmp_path / "rules").mkdir()
    rules = (RULES / "dialspec-alerts.yml").read_text()
    assert "dialspec:request_5xx:ratio_5m > 0.05" in rules
    (tmp_path / "rules" / "dialspec-alerts.yml").write_text(
        rules.replace("ratio_5m > 0.05", "ratio_5m > 0.5")
    )
    tests = RULE_TESTS.read_text().replace("../../deploy/prometheus/rules/", "rules/")
    (tmp_path / "t.yml").write_text(tests)
    out = subprocess.run(
        [tool("promtool"), "test", "rules", str(tmp_path / "t.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "DialspecHigh5xxRatio" in out.stdout + out.stderr, out.stdout


# ------------------------------------------------------------------------------------ a real Prometheus
SCRAPE_S = 1  # scrape and rule evaluation interval of the test's Prometheus


def _prometheus_config(tmp_path: Path, gateways: list[str], port: int) -> Path:
    """deploy/prometheus/prometheus.cpu.yml with the gateway job pointed at `gateways`, its own job
    at 127.0.0.1:`port`, 1 s intervals, and the rule files by absolute path."""
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.cpu.yml")
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    config["rule_files"] = [str(RULES / Path(p).name) for p in config["rule_files"]]
    targets = {"dialspec-gateway": gateways, "prometheus": [f"127.0.0.1:{port}"]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets.pop(job["job_name"])}]
    assert not targets, f"jobs missing from prometheus.cpu.yml: {targets}"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


class Prometheus:
    """Debian's prometheus server on 127.0.0.1, storage in a temp dir; `query` is the HTTP API."""

    def __init__(self, config: Path, port: int, workdir: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "prometheus.log"
        cmd = [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait_until(self, what: str, check, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-3000:]}"
            try:
                result = check()
            except httpx.TransportError:
                result = None
            if result:
                return result
            time.sleep(0.25)
        pytest.fail(f"prometheus: {what} within {timeout:.0f} s; log: {self.log.read_text()[-3000:]}")

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _has_numbers(result: list[dict]) -> bool:
    return any(not math.isnan(float(sample["value"][1])) for sample in result)


def test_a_real_prometheus_gets_data_for_every_query(live_gateway, adaptive_gateway, tmp_path):
    """Two gateways in the scrape job (fixed N as compose runs it, and adaptive N); two rounds of
    traffic at both (so every counter has increased between scrapes); then every query of the
    dashboard and of metrics.py's docstring returns at least one number, and every rule of
    deploy/prometheus/rules is loaded and evaluates without error."""
    (url, tiers), (adaptive_url, _) = live_gateway, adaptive_gateway
    port = free_port()
    gateways = [u.removeprefix("http://") for u in (url, adaptive_url)]
    prom = Prometheus(_prometheus_config(tmp_path, gateways, port), port, tmp_path)
    try:
        prom.wait_until("ready", lambda: httpx.get(prom.url + "/-/ready", timeout=5).status_code == 200)
        up = 'up{job="dialspec-gateway"} == 1'
        prom.wait_until("scraping both gateways", lambda: len(prom.query(up)) == 2)
        for _ in range(2):  # creates the tier-labelled series, then increases them
            for base in (url, adaptive_url):
                drive_traffic(base, tiers)
            time.sleep(3 * SCRAPE_S)

        queries = [as_promql(e).replace("[1m]", "[2m]") for e in dashboard_queries()] + docstring_promql()
        assert len(queries) >= 25 and len(docstring_promql()) >= 7
        empty = []
        for expr in queries:
            try:
                prom.wait_until("data", lambda e=expr: _has_numbers(prom.query(e)), timeout=10)
            except pytest.fail.Exception:
                empty.append(expr)
        assert not empty, "queries without data:\n" + "\n".join(empty)

        # The rules: loaded, evaluated without error, and the recording rules have data.
        def rules_evaluated():
            groups = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return (
                rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None
            )

        rules = prom.wait_until("evaluating the rules", rules_evaluated)
        declared = [r for g in load_yaml(RULES / "dialspec-alerts.yml")["groups"] for r in g["rules"]]
        assert len(rules) == len(declared)
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        recorded = [r["record"] for r in declared if "record" in r]
        for name in recorded:
            assert prom.query(name), f"recording rule {name} has no data"
        firing = [a for a in prom.query("ALERTS") if a["metric"]["alertstate"] == "firing"]
        assert not firing, firing  # a healthy gateway: nothing fires
        ready = prom.query("dialspec:ready")
        assert [float(s["value"][1]) for s in ready] == [1.0, 1.0]
    finally:
        prom.stop()
