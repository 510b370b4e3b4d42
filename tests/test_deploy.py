"""Deployment files, checked statically (CI has no Docker engine and no GPU): compose and images.

What runs here: the compose files pass `docker-compose config` with deploy/.env.example; every
file, image, port and variable they name exists or is documented; the Dockerfile's stages, COPY
sources and pins; the runtime's launch line as compose configures it (`dialspec runtime launch`,
the one source of SGLang's flags, checked with SGLang's own argument parser) and the router
script's; the READMEs say what is checked. The rest of deploy/ is checked by
test_deploy_lint.py (yamllint, the Compose Specification schema, the Kubernetes API schemas,
hadolint), test_deploy_k8s.py and test_deploy_monitoring.py (promtool, a real Prometheus).

docker-compose comes from `make deploy-tools` (part of `make test`); a missing tool fails the test
with that hint instead of skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy_files import (
    COMPOSE_FILES,
    DEPLOY,
    ENV_EXAMPLE,
    LISTEN,
    ROOT,
    RUNTIME_COMMAND,
    VAR_RE,
    compose_cmd,
    dockerfile_args,
    dockerfile_stages,
    dockerignored,
    documented_env_vars,
    env_example,
    launch_line,
    load_yaml,
    sglang_parse,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


# --------------------------------------------------------------------------------------------- compose
@pytest.mark.parametrize("kind", sorted(COMPOSE_FILES))
def test_compose_file_references_exist(kind):
    path = COMPOSE_FILES[kind]
    doc = load_yaml(path)
    services = doc["services"]
    stages = dockerfile_stages()
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
    missing = used - documented_env_vars()
    assert not missing, f"document these in deploy/.env.example: {sorted(missing)}"
    for m in VAR_RE.finditer(text):
        if m.group(2) == ":?":  # required: .env.example must give a usable value
            assert env_example().get(m.group(1)), f"{m.group(1)} is required but empty in .env.example"
    assert not re.search(r"\$[A-Za-z_]", re.sub(r"\$\{[^}]*\}", "", text)), "use ${VAR} forms only"


def test_env_example_has_no_unused_variables():
    used = set()
    for path in COMPOSE_FILES.values():
        used |= {m.group(1) for m in VAR_RE.finditer(path.read_text())}
    unused = set(env_example()) - used - {"COMPOSE_PROFILES"}
    assert not unused, f"variables in .env.example that no compose file reads: {sorted(unused)}"
    json.loads(env_example()["TIERS"])  # the gateway parses DIALSPEC_TIERS as JSON


@pytest.mark.parametrize(
    ("kind", "profiles"), [("cpu", ""), ("gpu", ""), ("gpu", "router")], ids=["cpu", "gpu", "gpu-router"]
)
def test_compose_config_validates(kind, profiles):
    """The compose implementation itself checks the schema and the interpolation."""
    env = {k: v for k, v in os.environ.items() if k not in documented_env_vars()}  # .env.example alone
    env["COMPOSE_PROFILES"] = profiles
    cmd = [*compose_cmd(), "--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILES[kind])]
    out = subprocess.run(
        [*cmd, "--env-file", str(ENV_EXAMPLE), "config"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    gateway_env = resolved["services"]["gateway"]["environment"]
    assert json.loads(gateway_env["DIALSPEC_TIERS"]) == json.loads(env_example()["TIERS"])
    if kind == "gpu":
        runtime_env = resolved["services"]["runtime"]["environment"]
        assert runtime_env["DIALSPEC_TARGET_MODEL"] == env_example()["TARGET_MODEL"]
        if profiles == "router":  # (compose v1 lists profiled services either way)
            assert "router" in resolved["services"]


# --------------------------------------------------------------------------------------------- images
def test_dockerfile_stages_and_copy_sources():
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    args = dockerfile_args()
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
                    assert not dockerignored(src), f"{name}: COPY source {src} is excluded by .dockerignore"

    # The build context (`COPY . ...`) carries the packages pyproject installs, and no local junk.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert not dockerignored(f"{package}/__init__.py"), f"{package}/ is excluded from the build"
    for needed in (
        "pyproject.toml",
        "README.md",
        "models/embedded/target/config.json",
        "deploy/scripts/router.sh",
    ):
        assert not dockerignored(needed), f"{needed} must reach the build context"
    for junk in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_deploy.py",
        "server/__pycache__/x.pyc",
        "deploy/.env",
    ):
        assert dockerignored(junk), f"{junk} must stay out of the build context"

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


@pytest.mark.parametrize("head", [False, True], ids=["no-head", "head"])
def test_compose_runtime_launch_line_parses_with_sglang(head, tmp_path, monkeypatch, capsys):
    """The runtime service as `docker-compose config` resolves it from .env.example, run through
    `dialspec runtime print-command`, gives a command line SGLang 0.5.23's own parser accepts."""
    env = {k: v for k, v in os.environ.items() if k not in documented_env_vars()}
    if head:
        (tmp_path / "head").mkdir()
        env["HEAD_PATH"] = str(tmp_path / "head")
    cmd = [*compose_cmd(), "--project-directory", str(DEPLOY), "-f", str(COMPOSE_FILES["gpu"])]
    out = subprocess.run(
        [*cmd, "--env-file", str(ENV_EXAMPLE), "config"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    runtime = yaml.safe_load(out.stdout)["services"]["runtime"]
    flags = launch_line(runtime["command"], runtime["environment"], monkeypatch, capsys)
    parsed = sglang_parse(flags)
    example = env_example()
    assert parsed.model_path == example["TARGET_MODEL"]
    assert parsed.speculative_draft_model_path == example["DRAFT_MODEL"]
    n = int(example["NUM_DRAFT"])
    assert parsed.speculative_algorithm == "STANDALONE" and parsed.speculative_num_steps == n
    assert parsed.speculative_num_draft_tokens == n + 1 and parsed.speculative_eagle_topk == 1
    assert parsed.speculative_use_rejection_sampling and parsed.enable_metrics
    assert parsed.host == "0.0.0.0" and parsed.port == LISTEN["runtime"]
    assert parsed.disable_cuda_graph is head  # a head needs every CUDA graph off


def test_router_script(tmp_path):
    urls = "http://runtime:30000 http://gpu-node-2:30000"
    argv = _run_script("router.sh", {"ROUTER_WORKER_URLS": urls}, tmp_path)[-1][0]
    assert argv[:2] == ["-m", "sglang_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == urls.split()
    assert argv[argv.index("--port") + 1] == "30000" and argv[argv.index("--prometheus-port") + 1] == "29000"
    assert argv[argv.index("--policy") + 1] == "cache_aware"


# --------------------------------------------------------------------------------------------- docs
def test_docs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Deploying on a GPU node", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 3, commands
    assert "None of the GPU deployment has been executed" in section
    details = (DEPLOY / "README.md").read_text()
    # What stands in for execution is named, in both READMEs.
    checks = ("yamllint", "check-jsonschema", "kubernetes-validate", "hadolint", "promtool test rules")
    for needed in (*checks, "real Prometheus"):
        assert needed in section and needed in details, f"README.md and deploy/README.md should name {needed}"
    for needed in (
        "DIALSPEC_BACKEND",
        "DIALSPEC_SGLANG_URL",
        "None of this has been executed",
        "--profile router",
        "kubectl",
        "DialspecAcceptanceCollapse",
        "fetch-tokenizer",
    ):
        assert needed in details, f"deploy/README.md should mention {needed}"
    assert "not in the code yet" not in details, "the backend variables are handled (server/gateway/serve.py)"
