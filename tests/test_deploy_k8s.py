"""The k8s manifests (deploy/k8s), read as `kubectl apply -k` would apply them: selectors, ports,
URLs and probes agree; the runtime's launch line parses with SGLang's own parser; the gateway gets
the same model, tokenizer source and N as the runtime (all from the ConfigMap); the Prometheus
rules ConfigMap is deploy/prometheus/rules/dialspec-alerts.yml. Schema validation against the
Kubernetes API is in test_deploy_lint.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from server.gateway.serve import parse_num_draft
from tests.deploy_files import (
    DEPLOY,
    K8S,
    RUNTIME_COMMAND,
    dockerfile_stages,
    k8s_docs,
    launch_line,
    load_yaml,
    sglang_parse,
)

CONFIG = ("ConfigMap", "dialspec-config")


def container_env(container: dict, docs: dict) -> dict[str, str | None]:
    """The container's environment as the kubelet builds it (envFrom, then env; a Secret's value
    is unknown here: None)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        env.update(docs[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = docs[("ConfigMap", ref["name"])]["data"][ref["key"]]
        else:
            env[var["name"]] = None
    return env


def expand(words: list[str], env: dict[str, str | None]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command/args (a reference to an unset variable stays)."""

    def one(m: re.Match) -> str:
        value = env.get(m.group(1))
        return m.group(0) if value is None else value

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, w) for w in words]


def _pod(docs: dict, name: str) -> dict:
    kind = "StatefulSet" if name == "dialspec-runtime" else "Deployment"
    return docs[(kind, name)]["spec"]["template"]["spec"]


def _image_env(stage: str) -> dict[str, str]:
    """ENV of a Dockerfile stage (KEY=VALUE pairs)."""
    env = {}
    for word, rest in dockerfile_stages()[stage]:
        if word == "ENV":
            env.update(dict(pair.split("=", 1) for pair in rest.split()))
    return env


def test_k8s_runtime_launch_line_parses_with_sglang(monkeypatch, capsys):
    docs = k8s_docs()
    config = docs[("ConfigMap", "dialspec-config")]["data"]
    (container,) = docs[("StatefulSet", "dialspec-runtime")]["spec"]["template"]["spec"]["containers"]
    env = {**config, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    parsed = sglang_parse(launch_line(container["command"], env, monkeypatch, capsys))
    assert parsed.model_path == config["DIALSPEC_TARGET_MODEL"] and parsed.port == 30000
    assert parsed.speculative_num_steps == int(config["DIALSPEC_NUM_DRAFT"]) and parsed.host == "0.0.0.0"


def test_k8s_manifests_agree():
    docs = k8s_docs()
    kustomization = load_yaml(K8S / "kustomization.yaml")
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


def test_gateway_and_runtime_agree_on_model_tokenizer_and_n(monkeypatch, capsys, tiny_pair):
    """Rendered from the ConfigMap: the runtime's SGLang flags and the gateway's `dialspec serve`
    line name the same model (the gateway's tokenizer) and the same N; the gateway's tokenizer
    is fetched into the HF cache its container reads offline, as the runtime's model is."""
    docs = k8s_docs()
    config = docs[CONFIG]["data"]
    runtime_pod, gateway_pod = _pod(docs, "dialspec-runtime"), _pod(docs, "dialspec-gateway")
    (runtime,) = runtime_pod["containers"]
    (gateway,) = gateway_pod["containers"]
    runtime_env = container_env(runtime, docs)
    sglang = sglang_parse(launch_line(runtime["command"], runtime_env, monkeypatch, capsys))

    gateway_env = container_env(gateway, docs)
    command = expand(gateway["command"], gateway_env)
    assert command[:2] == ["dialspec", "serve"] and not any("$(" in w for w in command), command
    for key, value in gateway_env.items():  # serve's flag defaults read these
        if value is not None:
            monkeypatch.setenv(key, value)
    from server.cli import build_parser

    args = build_parser()[0].parse_args(command[1:])
    assert args.backend == "sglang" and args.sglang_url == "http://dialspec-router:30000"
    assert args.tokenizer == sglang.model_path == config["DIALSPEC_TARGET_MODEL"]
    assert (
        parse_num_draft(args.num_draft) == sglang.speculative_num_steps == int(config["DIALSPEC_NUM_DRAFT"])
    )

    # The tokenizer's source: the init container downloads exactly DIALSPEC_TOKENIZER (online, with
    # the runtime's optional HF token) into a volume mounted where the gateway's HF cache is; the
    # gateway container itself stays offline, as the image sets it.
    image_env = _image_env("cpu")
    assert image_env["HF_HUB_OFFLINE"] == "1" and gateway_env.get("HF_HUB_OFFLINE", "1") == "1"
    hf_home = image_env["HF_HOME"]
    (fetch,) = gateway_pod["initContainers"]
    fetch_env = container_env(fetch, docs)
    assert fetch["image"] == gateway["image"] and fetch_env["HF_HUB_OFFLINE"] == "0"
    assert fetch_env["DIALSPEC_TOKENIZER"] == args.tokenizer
    secrets = {
        v["name"]: v["valueFrom"]["secretKeyRef"]
        for v in fetch["env"]
        if "secretKeyRef" in v.get("valueFrom", {})
    }
    runtime_secrets = {
        v["name"]: v["valueFrom"]["secretKeyRef"]
        for v in runtime["env"]
        if "secretKeyRef" in v.get("valueFrom", {})
    }
    assert secrets["HF_TOKEN"] == runtime_secrets["HF_TOKEN"]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (fetch, gateway)}
    volume = next(name for name, path in mounts["gateway"].items() if path == hf_home)
    assert mounts["fetch-tokenizer"][volume] == hf_home
    assert volume in {v["name"] for v in gateway_pod["volumes"]}
    # The script itself runs (a local directory: nothing to download).
    script = fetch["command"][2]
    target, _ = tiny_pair
    out = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "DIALSPEC_TOKENIZER": str(target)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_prometheus_rules_configmap_is_the_rules_file():
    rules = DEPLOY / "prometheus" / "rules" / "dialspec-alerts.yml"
    data = k8s_docs()[("ConfigMap", "dialspec-prometheus-rules")]["data"]
    assert data == {rules.name: rules.read_text()}, (
        "deploy/k8s/prometheus-rules.yaml must carry deploy/prometheus/rules/dialspec-alerts.yml "
        "unchanged (kustomize reads no file outside deploy/k8s): copy it into `data`"
    )
    assert load_yaml(K8S / "kustomization.yaml")["resources"].count("prometheus-rules.yaml") == 1
