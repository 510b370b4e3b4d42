"""Deployment files, checked statically (CI has no Docker engine and no GPU).

What runs here: the compose files parse (PyYAML) and pass `docker-compose config` with
deploy/.env.example; every file, image, port and variable they name exists or is documented; the
Dockerfile's stages, COPY sources and pins; the runtime's launch line as compose and k8s configure
it (`dialspec runtime launch`, the one source of SGLang's flags, checked with SGLang's own argument
parser) and the router script's; the Prometheus configs pass `promtool check config`; every
dashboard query is valid PromQL (`promtool check rules`) and every metric name it uses is on a live
`dialspec serve`'s /metrics; the k8s manifests' selectors, ports and URLs agree.

promtool and docker-compose come from `make deploy-tools` (part of `make test`); a missing tool
fails the test with that hint instead of skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = {"gpu": DEPLOY / "docker-compose.gpu.yml", "cpu": DEPLOY / "docker-compose.cpu.yml"}
ENV_EXAMPLE = DEPLOY / ".env.example"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dialspec.json"
K8S = DEPLOY / "k8s"
TOOLS_HINT = "run `make deploy-tools` (Debian packages prometheus and docker-compose; needs root or sudo)"

# Ports the programs inside the containers listen on.
LISTEN = {"runtime": 30000, "router": 30000, "gateway": 8000, "prometheus": 9090, "grafana": 3000}
# Every runtime (image CMD, compose, k8s) starts SGLang through the one flag builder.
RUNTIME_COMMAND = ["dialspec", "runtime", "launch", "--host", "0.0.0.0"]
METRIC_RE = re.compile(r"\bdialspec:[A-Za-z0-9_:]+")
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


# --------------------------------------------------------------------------------------------- helpers
def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _env_example() -> dict[str, str]:
    """KEY=VALUE lines of deploy/.env.example (values unquoted as compose does)."""
    env = {}
    for raw in ENV_EXAMPLE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f".env.example: bad line {raw!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def _documented_env_vars() -> set[str]:
    """Variables set in .env.example, including the commented-out examples (`# KEY=...`)."""
    return set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.M))


def _tool(name: str) -> str:
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"{name} not found: {TOOLS_HINT}")


def _compose_cmd() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    pytest.fail(f"docker-compose not found: {TOOLS_HINT}")


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the root Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in _dockerfile_instructions():
        if word == "FROM":
            parts = rest.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"name every stage: FROM {rest}"
            current = parts[2]
            stages[current] = [(word, parts[0])]
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def _dockerfile_args() -> dict[str, str]:
    args = {}
    for word, rest in _dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    return args


def _segments_match(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], pattern[0]) and _segments_match(pattern[1:], path[1:])


def _dockerignored(rel: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent decides."""
    parts = rel.strip("/").split("/")
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(_segments_match(pat.split("/"), parts[:n]) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _dashboard_panels() -> list[dict]:
    panels = []
    for p in _dashboard()["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    return panels


def _dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the variables' queries."""
    exprs = [t["expr"] for p in _dashboard_panels() for t in p.get("targets", [])]
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>), got {q!r}"
            exprs.append(m.group(1))
    return exprs


def _as_promql(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    for var, value in (("$__rate_interval", "1m"), ("$__interval", "15s"), ("$__range", "1h")):
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


# --------------------------------------------------------------------------------------------- compose
@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_compose_file_references_exist(kind):
    path = COMPOSE_FILES[kind]
    doc = _yaml(path)
    services = doc["services"]
    stages = _dockerfile_stages()
    assert "gateway" in services and "prometheus" in services and "grafana" in services
    for name, svc in services.items():
        image = svc.get("image", "")
        m = VAR_RE.fullmatch(image)
        pinned = m.group(3) if m else image  # the default of ${IMAGE:-default}
        assert pinned and ":" in pinned and not pinned.endswith(":latest"), f"{name}: pin the image ({image})"
        if "build" in svc:
            build = svc["build"]
            context = (path.parent / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context should be the repository root"
            assert (context / build.get("dockerfile", "Dockerfile")).is_file()
            assert build["target"] in stages, f"{name}: no Dockerfile stage {build['target']!r}"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")) and "$" not in source:
                assert (path.parent / source).exists(), f"{name}: volume source {source} does not exist"
        listen = LISTEN[name]
        for port in svc.get("ports", []):
            assert int(str(port).rsplit(":", 1)[1]) == listen, f"{name}: container port of {port} != {listen}"
        health = svc.get("healthcheck")
        if name in ("runtime", "router", "gateway"):
            assert health, f"{name}: needs a healthcheck"
            # The gateway's check is readiness (503 while draining, failed or probing: issue 12);
            # runtimes and the router answer /health.
            probe = "/ready" if name == "gateway" else "/health"
            assert f"http://127.0.0.1:{listen}{probe}" in " ".join(health["test"])
        assert svc.get("restart") == "unless-stopped"

    gateway_env = services["gateway"]["environment"]
    # Docker kills after stop_grace_period: it must cover the drain plus uvicorn's 15 s after it.
    grace = int(services["gateway"]["stop_grace_period"].rstrip("s"))
    assert grace >= float(gateway_env["DIALSPEC_DRAIN_TIMEOUT_S"]) + 15
    if kind == "gpu":
        runtime = services["runtime"]
        assert runtime["ipc"] == "host"
        assert runtime["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        ]
        assert "/root/.cache/huggingface" in " ".join(runtime["volumes"]), "HF cache volume"
        assert runtime["command"] == RUNTIME_COMMAND
        assert runtime["environment"]["DIALSPEC_SGLANG_PLUGIN"] == "1"
        assert gateway_env["DIALSPEC_BACKEND"] == "sglang"
        assert gateway_env["DIALSPEC_SGLANG_URL"] == "${DIALSPEC_SGLANG_URL:-http://runtime:30000}"
        assert services["gateway"]["depends_on"]["runtime"]["condition"] == "service_healthy"
        router = services["router"]
        assert router["profiles"] == ["router"] and router["command"] == ["dialspec-router"]
    else:
        assert set(services) == {"gateway", "prometheus", "grafana"}, "the laptop stack has no runtime"
        assert gateway_env["DIALSPEC_BACKEND"] == "embedded"
        assert "deploy" not in services["gateway"]
    assert services["gateway"]["command"][:2] == ["dialspec", "serve"]
    prom_volume = services["prometheus"]["volumes"][0].split(":")
    assert prom_volume[0] == f"./prometheus/prometheus.{kind}.yml"
    assert prom_volume[1] == "/etc/prometheus/prometheus.yml"


@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_compose_variables_are_documented(kind):
    text = COMPOSE_FILES[kind].read_text()
    used = {m.group(1) for m in VAR_RE.finditer(text)}
    missing = used - _documented_env_vars()
    assert not missing, f"document these in deploy/.env.example: {sorted(missing)}"
    for m in VAR_RE.finditer(text):
        if m.group(2) == ":?":  # required: .env.example must give a usable value
            assert _env_example().get(m.group(1)), f"{m.group(1)} is required but empty in .env.example"
    assert not re.search(r"\$[A-Za-z_]", re.sub(r"\$\{[^}]*\}", "", text)), "use ${VAR} forms only"


def test_env_example_has_no_unused_variables():
    used = set()
    for path in COMPOSE_FILES.values():
        used |= {m.group(1) for m in VAR_RE.finditer(path.read_text())}
    unused = set(_env_example()) - used - {"COMPOSE_PROFILES"}
    assert not unused, f"variables in .env.example that no compose file reads: {sorted(unused)}"
    json.loads(_env_example()["TIERS"])  # the gateway parses DIALSPEC_TIERS as JSON


@pytest.mark.parametrize(
    ("kind", "profiles"), [("cpu", ""), ("gpu", ""), ("gpu", "router")], ids=["cpu", "gpu", "gpu-router"]
)
def test_compose_config_validates(kind, profiles):
    """The compose implementation itself checks the schema and the interpolation."""
    env = {k: v for k, v in os.environ.items() if k not in _documented_env_vars()}  # .env.example alone
    env["COMPOSE_PROFILES"] = profiles
    cmd = [*_compose_cmd(), "--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILES[kind])]
    out = subprocess.run(
        [*cmd, "--env-file", str(ENV_EXAMPLE), "config"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    gateway_env = resolved["services"]["gateway"]["environment"]
    assert json.loads(gateway_env["DIALSPEC_TIERS"]) == json.loads(_env_example()["TIERS"])
    if kind == "gpu":
        runtime_env = resolved["services"]["runtime"]["environment"]
        assert runtime_env["DIALSPEC_TARGET_MODEL"] == _env_example()["TARGET_MODEL"]
        if profiles == "router":  # (compose v1 lists profiled services either way)
            assert "router" in resolved["services"]


# --------------------------------------------------------------------------------------------- images
def test_dockerfile_stages_and_copy_sources():
    stages = _dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    args = _dockerfile_args()
    for name, body in stages.items():
        for word, rest in body:
            if word not in ("COPY", "ADD"):
                continue
            tokens = shlex.split(rest)
            flags = [t for t in tokens if t.startswith("--")]
            paths = [t for t in tokens if not t.startswith("--")]
            assert len(paths) >= 2, f"{name}: {word} {rest}"
            src_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if src_stage:
                assert src_stage in stages, f"{name}: COPY --from={src_stage}: no such stage"
                continue
            for src in paths[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY source {src} does not exist"
                if src != ".":
                    assert not _dockerignored(src), f"{name}: COPY source {src} is excluded by .dockerignore"

    # The build context (`COPY . ...`) carries the packages pyproject installs, and no local junk.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert not _dockerignored(f"{package}/__init__.py"), f"{package}/ is excluded from the build"
    for needed in (
        "pyproject.toml",
        "README.md",
        "models/embedded/target/config.json",
        "deploy/scripts/router.sh",
    ):
        assert not _dockerignored(needed), f"{needed} must reach the build context"
    for junk in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_deploy.py",
        "server/__pycache__/x.pyc",
        "deploy/.env",
    ):
        assert _dockerignored(junk), f"{junk} must stay out of the build context"

    # Pins agree with pyproject and the Makefile.
    sglang_pin = next(
        r for r in pyproject["project"]["optional-dependencies"]["sglang"] if r.startswith("sglang")
    )
    assert args["SGLANG_IMAGE"] == "lmsysorg/sglang:v" + sglang_pin.split("==")[1]
    assert stages["gpu"][0] == ("FROM", "${SGLANG_IMAGE}")
    assert f'"torch=={args["TORCH_VERSION"]}"' in (ROOT / "Makefile").read_text()
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")

    cpu = dict(stages["cpu"])  # last of each instruction
    user = cpu["USER"]
    assert user not in ("root", "0"), "the CPU image runs as a non-root user"
    assert "/health" in cpu["HEALTHCHECK"] and "8000" in cpu["HEALTHCHECK"]
    assert json.loads(cpu["CMD"])[:2] == ["dialspec", "serve"]
    gpu = dict(stages["gpu"])
    install = next(rest for word, rest in stages["gpu"] if word == "RUN" and "pip install" in rest)
    # The image's sglang is editable (left out of the constraints), so installing the [sglang]
    # extra could pull a second sglang over it: the gpu image installs dialspec alone, pins every
    # other package, and checks torch/sglang are untouched and sglang is pyproject's version.
    assert "-c /tmp/image-constraints.txt -e /opt/dialspec" in install and "[sglang]" not in install
    assert "--exclude-editable" in install and "diff /tmp/stack-before.txt /tmp/stack-after.txt" in install
    assert "['optional-dependencies']['sglang']" in install
    assert "/health" in gpu["HEALTHCHECK"] and json.loads(gpu["CMD"]) == RUNTIME_COMMAND
    assert "runtime.sh" not in (ROOT / "Dockerfile").read_text()
    assert not (DEPLOY / "scripts" / "runtime.sh").exists(), "launch flags have one source: runtime_cli"


def _run_script(script: str, env: dict[str, str], tmp_path: Path) -> list[tuple[list[str], str | None]]:
    """Run a deploy/scripts/*.sh with a stand-in `python3` that records its argv."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    fake = fake_bin / "python3"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "call = sys.argv[1:] + ['ENV', os.environ.get('DIALSPEC_SGLANG_PLUGIN')]\n"
        f"open({str(log)!r}, 'a').write(json.dumps(call) + '\\n')\n"
    )
    fake.chmod(0o755)
    full_env = {"PATH": f"{fake_bin}:/usr/bin:/bin", **env}
    out = subprocess.run(
        ["sh", str(DEPLOY / "scripts" / script)], env=full_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [(c[:-2], c[-1]) for c in calls]  # (argv, DIALSPEC_SGLANG_PLUGIN as the program saw it)


def _launch_line(command: list[str], env: dict[str, str], monkeypatch, capsys) -> list[str]:
    """The SGLang argv `command` (a `dialspec runtime launch ...` line) execs under `env`."""
    from server import cli

    assert command[:3] == ["dialspec", "runtime", "launch"], command
    for var in list(os.environ):
        if var.startswith(("DIALSPEC_", "SGLANG_")):
            monkeypatch.delenv(var)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    assert cli.main(["runtime", "print-command", *command[3:]]) == 0, capsys.readouterr().err
    words = shlex.split(capsys.readouterr().out)
    return words[words.index("-m") + 2 :]


def _sglang_parse(flags: list[str]):
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang is not installed: its parser did not check the launch line"
    )
    return server_args.prepare_server_args(flags)


@pytest.mark.parametrize("head", [False, True], ids=["no-head", "head"])
def test_compose_runtime_launch_line_parses_with_sglang(head, tmp_path, monkeypatch, capsys):
    """The runtime service as `docker-compose config` resolves it from .env.example, run through
    `dialspec runtime print-command`, gives a command line SGLang 0.5.23's own parser accepts."""
    env = {k: v for k, v in os.environ.items() if k not in _documented_env_vars()}
    if head:
        (tmp_path / "head").mkdir()
        env["HEAD_PATH"] = str(tmp_path / "head")
    cmd = [*_compose_cmd(), "--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILES["gpu"])]
    out = subprocess.run(
        [*cmd, "--env-file", str(ENV_EXAMPLE), "config"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    runtime = yaml.safe_load(out.stdout)["services"]["runtime"]
    flags = _launch_line(runtime["command"], runtime["environment"], monkeypatch, capsys)
    parsed = _sglang_parse(flags)
    example = _env_example()
    assert parsed.model_path == example["TARGET_MODEL"]
    assert parsed.speculative_draft_model_path == example["DRAFT_MODEL"]
    n = int(example["NUM_DRAFT"])
    assert parsed.speculative_algorithm == "STANDALONE" and parsed.speculative_num_steps == n
    assert parsed.speculative_num_draft_tokens == n + 1 and parsed.speculative_eagle_topk == 1
    assert parsed.speculative_use_rejection_sampling and parsed.enable_metrics
    assert parsed.host == "0.0.0.0" and parsed.port == LISTEN["runtime"]
    assert parsed.disable_cuda_graph is head  # a head needs every CUDA graph off


def test_k8s_runtime_launch_line_parses_with_sglang(monkeypatch, capsys):
    docs = _k8s_docs()
    config = docs[("ConfigMap", "dialspec-config")]["data"]
    (container,) = docs[("StatefulSet", "dialspec-runtime")]["spec"]["template"]["spec"]["containers"]
    env = {**config, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    parsed = _sglang_parse(_launch_line(container["command"], env, monkeypatch, capsys))
    assert parsed.model_path == config["DIALSPEC_TARGET_MODEL"] and parsed.port == 30000
    assert parsed.speculative_num_steps == int(config["DIALSPEC_NUM_DRAFT"]) and parsed.host == "0.0.0.0"


def test_router_script(tmp_path):
    urls = "http://runtime:30000 http://gpu-node-2:30000"
    argv = _run_script("router.sh", {"ROUTER_WORKER_URLS": urls}, tmp_path)[-1][0]
    assert argv[:2] == ["-m", "sglang_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == urls.split()
    assert argv[argv.index("--port") + 1] == "30000" and argv[argv.index("--prometheus-port") + 1] == "29000"
    assert argv[argv.index("--policy") + 1] == "cache_aware"


# --------------------------------------------------------------------------------------------- prometheus
@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_prometheus_config_passes_promtool(kind):
    config = DEPLOY / "prometheus" / f"prometheus.{kind}.yml"
    out = subprocess.run(
        [_tool("promtool"), "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    services = _yaml(COMPOSE_FILES[kind])["services"]
    targets = {
        job["job_name"]: target
        for job in _yaml(config)["scrape_configs"]
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
                    {"record": f"dialspec_dashboard:query_{i}", "expr": _as_promql(expr)}
                    for i, expr in enumerate(_dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(
        [_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------------------------- grafana
def test_dashboard_panels_and_provisioning():
    dash = _dashboard()
    panels = [p for p in _dashboard_panels() if p["type"] != "row"]
    ids = [p["id"] for p in _dashboard_panels()]
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
    queries = "\n".join(_dashboard_queries())
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, tier) (rate(dialspec:{hist}_bucket" in queries
    # The tier variable filters the tier-labelled panels.
    assert dash["templating"]["list"][1]["name"] == "tier" and 'tier=~"$tier"' in queries

    datasource = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][
        0
    ]
    assert datasource["uid"] == dash["templating"]["list"][0]["current"]["value"]
    assert datasource["url"] == "http://prometheus:9090"
    provider = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dialspec.yml")["providers"][0]
    for path in COMPOSE_FILES.values():
        grafana = _yaml(path)["services"]["grafana"]
        mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
        assert mounts["./grafana/dashboards"] == provider["options"]["path"]
        assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
        assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
            provider["options"]["path"] + "/" + DASHBOARD.name
        )


def _start_gateway(target: Path, draft: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--target", str(target), "--draft", str(draft)]
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-context",
        "256",
        "--num-draft",
        "3",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT)
    )
    line = proc.stdout.readline()  # printed once the server listens
    match = re.search(r"(http://\S+)/v1", line)
    if not match:
        proc.kill()
        pytest.fail(f"dialspec serve did not start: {line!r} {proc.stderr.read()}")
    return proc, match.group(1)


def test_dashboard_metrics_exist_on_a_live_gateway(tiny_pair):
    """Every `dialspec:` name the dashboard queries is a series on the real gateway's /metrics,
    with the gateway configured from .env.example the way the compose files configure it."""
    settings_env = _env_example()
    # The gateway's settings come from .env.example alone (the test cache dir stays: see conftest).
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIALSPEC_") or k == "DIALSPEC_CACHE_DIR"}
    env.update(
        DIALSPEC_BACKEND="embedded",
        DIALSPEC_TIERS=settings_env["TIERS"],
        DIALSPEC_DEFAULT_QUALITY=settings_env["DEFAULT_QUALITY"],
        DIALSPEC_MAX_WAITING=settings_env["MAX_WAITING"],
    )
    tiers = json.loads(settings_env["TIERS"])
    proc, url = _start_gateway(*tiny_pair, env)
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
            assert {f"{model}:{t}" for t in tiers} <= listed, listed
            msg = [{"role": "user", "content": "Tom has 12 apples"}]
            for quality in [*tiers, 0.4]:
                r = http.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": msg, "max_tokens": 8, "seed": 1, "quality": quality},
                )
                assert r.status_code == 200, r.text
            r = http.post(
                "/v1/chat/completions", json={"model": model, "messages": msg, "quality": "no-such-tier"}
            )
            assert r.status_code == 400  # feeds dialspec:request_errors_total
            exposition = http.get("/metrics").text
            assert http.get("/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    series: dict[str, set[tuple]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            series.setdefault(sample.name, set()).add(tuple(sorted(sample.labels.items())))
    used = sorted({m for expr in _dashboard_queries() for m in METRIC_RE.findall(expr)})
    assert len(used) >= 15
    missing = [m for m in used if m not in series]
    assert not missing, f"the dashboard queries series the gateway does not export: {missing}"
    # Tier-filtered queries only make sense on tier-labelled series; the tiers of .env.example show up.
    for expr in _dashboard_queries():
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


# --------------------------------------------------------------------------------------------- k8s
def _k8s_docs() -> dict[tuple[str, str], dict]:
    docs = {}
    kustomization = _yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        path = K8S / resource
        assert path.is_file(), f"kustomization names {resource}, which does not exist"
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{resource}: incomplete object"
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    listed = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(kustomization["resources"]), "every manifest is in the kustomization"
    return docs


def test_k8s_manifests_agree():
    docs = _k8s_docs()
    kustomization = _yaml(K8S / "kustomization.yaml")
    image_names = {i["name"] for i in kustomization["images"]}
    config = docs[("ConfigMap", "dialspec-config")]["data"]
    workloads = {name: d for (kind, name), d in docs.items() if kind in ("Deployment", "StatefulSet")}
    assert set(workloads) == {"dialspec-runtime", "dialspec-router", "dialspec-gateway"}
    for name, w in workloads.items():
        spec = w["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), f"{name}: selector misses the pods"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["image"] in image_names, f"{name}: image {container['image']} not in kustomization"
        port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in port_names, f"{name}: {probe} port"
        for source in container.get("envFrom", []):
            assert ("ConfigMap", source["configMapRef"]["name"]) in docs
        annotations = spec["template"]["metadata"].get("annotations", {})
        assert int(annotations["prometheus.io/port"]) in port_names.values()
    for (kind, name), svc in docs.items():
        if kind != "Service":
            continue
        matches = [
            w
            for w in workloads.values()
            if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} workloads"
        (container,) = matches[0]["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        assert all(p["targetPort"] in names for p in svc["spec"]["ports"]), f"Service {name}: targetPort"

    runtime = workloads["dialspec-runtime"]
    (rc,) = runtime["spec"]["template"]["spec"]["containers"]
    assert rc["resources"]["limits"]["nvidia.com/gpu"] == 1 and rc["command"] == RUNTIME_COMMAND
    service = runtime["spec"]["serviceName"]
    assert docs[("Service", service)]["spec"]["clusterIP"] == "None"
    expected = [
        f"http://{runtime['metadata']['name']}-{i}.{service}:30000"
        for i in range(runtime["spec"]["replicas"])
    ]
    assert config["ROUTER_WORKER_URLS"].split() == expected, "one router URL per runtime pod"
    gateway = workloads["dialspec-gateway"]
    (gc,) = gateway["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gc["env"]}
    assert (
        env["DIALSPEC_BACKEND"] == "sglang" and env["DIALSPEC_SGLANG_URL"] == "http://dialspec-router:30000"
    )
    assert gateway["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert gc["readinessProbe"]["httpGet"]["path"] == "/ready"
    # Kubernetes kills after terminationGracePeriodSeconds: the drain plus uvicorn's 15 s must fit.
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= float(env["DIALSPEC_DRAIN_TIMEOUT_S"]) + 15
    json.loads(config["DIALSPEC_TIERS"])


# --------------------------------------------------------------------------------------------- docs
def test_docs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Deploying on a GPU node", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 3, commands
    assert "None of the GPU deployment has been executed" in section
    details = (DEPLOY / "README.md").read_text()
    for needed in (
        "DIALSPEC_BACKEND",
        "DIALSPEC_SGLANG_URL",
        "None of this has been executed",
        "--profile router",
        "kubectl",
    ):
        assert needed in details, f"deploy/README.md should mention {needed}"
