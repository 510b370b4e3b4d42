"""Shared by tests/test_deploy*.py: the deploy/ paths; a YAML loader that refuses duplicate keys
(as Docker Compose v2 and kubectl do); the tools `make deploy-tools` and the [dev] extra install;
readers for .env.example, the Dockerfile, the Grafana dashboard and the k8s manifests; the
runtime's launch line as `dialspec runtime print-command` gives it; and a live `dialspec serve`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = {"gpu": DEPLOY / "docker-compose.gpu.yml", "cpu": DEPLOY / "docker-compose.cpu.yml"}
ENV_EXAMPLE = DEPLOY / ".env.example"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "dialspec.json"
K8S = DEPLOY / "k8s"
TOOLS_HINT = (
    "run `make deploy-tools` (Debian packages prometheus and docker-compose, needs root or sudo; "
    "the Python checkers come with pip install -e '.[dev]')"
)

# Ports the programs inside the containers listen on.
LISTEN = {"runtime": 30000, "router": 30000, "gateway": 8000, "prometheus": 9090, "grafana": 3000}
# Every runtime (image CMD, compose, k8s) starts SGLang through the one flag builder.
RUNTIME_COMMAND = ["dialspec", "runtime", "launch", "--host", "0.0.0.0"]
METRIC_RE = re.compile(r"\bdialspec:[A-Za-z0-9_:]+")
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping: Docker Compose v2 ("mapping
    key ... already defined") and kubectl refuse those files, while PyYAML (and docker-compose
    1.29) keep the last value silently."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may repeat
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=StrictLoader)


def load_yaml_all(path: Path) -> list:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=StrictLoader) if doc]


def env_example() -> dict[str, str]:
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


def documented_env_vars() -> set[str]:
    """Variables set in .env.example, including the commented-out examples (`# KEY=...`)."""
    return set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.M))


def tool(name: str) -> str:
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"{name} not found: {TOOLS_HINT}")


def compose_cmd() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    pytest.fail(f"docker-compose not found: {TOOLS_HINT}")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the root Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            parts = rest.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"name every stage: FROM {rest}"
            current = parts[2]
            stages[current] = [(word, parts[0])]
        elif current is not None:
            stages[current].append((word, rest))
    return stages


def dockerfile_args() -> dict[str, str]:
    args = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    return args


def segments_match(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(segments_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], pattern[0]) and segments_match(pattern[1:], path[1:])


def dockerignored(rel: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent decides."""
    parts = rel.strip("/").split("/")
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(segments_match(pat.split("/"), parts[:n]) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    panels = []
    for p in dashboard()["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    return panels


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the variables' queries."""
    exprs = [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>), got {q!r}"
            exprs.append(m.group(1))
    return exprs


def as_promql(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    for var, value in (("$__rate_interval", "1m"), ("$__interval", "15s"), ("$__range", "1h")):
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def launch_line(command: list[str], env: dict[str, str], monkeypatch, capsys) -> list[str]:
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


def sglang_parse(flags: list[str]):
    server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="sglang is not installed: its parser did not check the launch line"
    )
    return server_args.prepare_server_args(flags)


def start_gateway(
    target: Path, draft: Path, env: dict[str, str], num_draft: str = "3"
) -> tuple[subprocess.Popen, str]:
    """`dialspec serve` on the pair at 127.0.0.1 on a free port; (process, base URL)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--target", str(target), "--draft", str(draft)]
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-context",
        "256",
        "--num-draft",
        num_draft,
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


def k8s_docs() -> dict[tuple[str, str], dict]:
    docs = {}
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        path = K8S / resource
        assert path.is_file(), f"kustomization names {resource}, which does not exist"
        for doc in load_yaml_all(path):
            if doc:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{resource}: incomplete object"
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    listed = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(kustomization["resources"]), "every manifest is in the kustomization"
    return docs
