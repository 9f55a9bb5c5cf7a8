"""The deployment files as their tools read them, offline: the Kubernetes manifests rendered by
``kubectl kustomize`` and validated against the Kubernetes schemas (kubernetes-validate's,
strict: no unknown field), the compose files through ``docker-compose config``, and the
HAProxy configuration through ``haproxy -c``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"
# kinds of other projects' CRDs, which the Kubernetes schemas do not hold: checked by hand
CUSTOM = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is needed by these tests (make test installs it)"
    return path


def _render(kustomization: Path) -> list[dict]:
    out = subprocess.run(
        [_tool("kubectl"), "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("where", ["base", "overlays/gpu", "envoy-gateway", "inference-pool"])
def test_the_kubernetes_manifests_render_and_validate(where):
    import kubernetes_validate

    docs = _render(K8S / where)
    assert docs
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CUSTOM:
            assert d["metadata"]["name"] and isinstance(d["spec"], dict), d
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def _deployment(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")


def test_the_deployment_fits_the_servers_lifecycle():
    """Probes on /ready (in the ring only while loaded and not draining) and /health, a grace
    period past the server's drain, the URLs from a Secret, a disruption budget of one pod,
    and the GPU overlay asking for one GPU a pod."""
    docs = _render(K8S / "base")
    dep = _deployment(docs)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    grace = float(env["DOCQA_SHUTDOWN_GRACE_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] > grace + 5  # the preStop pause and a margin
    for name in ("DOCQA_DATABASE_URL", "DOCQA_REDIS_URL"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "docqa"
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for selector in (
        dep["spec"]["selector"]["matchLabels"],
        pdb["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == (
        "$docqa_manual"
    )
    gpu = _deployment(_render(K8S / "overlays" / "gpu"))["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    pool = _render(K8S / "inference-pool")
    ip = next(d for d in pool if d["kind"] == "InferencePool")
    assert ip["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_ingress_snippet_defines_the_key_it_hashes_on():
    cm = yaml.safe_load((K8S / "ingress-nginx" / "controller-configmap.yaml").read_text())
    snippet = cm["data"]["http-snippet"]
    assert "$docqa_manual " in snippet and "^/v1/manuals/" in snippet
    assert "$http_x_docqa_manual" in snippet


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]])
def test_compose_config_passes_with_the_balancer(files):
    args = [a for f in files for a in ("-f", str(ROOT / f))]
    out = subprocess.run(
        [_tool("docker-compose"), *args, "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    services = cfg["services"]
    assert {"lb", "api", "postgres", "redis"} <= set(services)
    assert services["api"]["deploy"]["replicas"] >= 2  # one service scaled, not copies
    assert "ports" not in services["api"]  # reached through the balancer
    assert any(str(p.get("published", p) if isinstance(p, dict) else p).startswith("8000")
               for p in services["lb"]["ports"])  # fmt: skip


def test_the_haproxy_configuration_is_valid():
    out = subprocess.run(
        [_tool("haproxy"), "-c", "-f", str(ROOT / "deploy" / "haproxy" / "haproxy.cfg")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr
