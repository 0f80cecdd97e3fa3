"""The Kubernetes example (deploy/k8s/) validated offline: every resource against Kubernetes' own
schemas (the PyPI package kubernetes-validate, strict: unknown fields refused), then what a schema
cannot see: one Deployment per role, a Service for the router's HTTP API and one for registration that
works before the router is ready, every advertised address the pod's own IP from the downward API
(never 0.0.0.0), readiness probes on ports the containers declare, the CURVE keys as Secrets (the
router's secret key never in a worker pod), and every container's arguments accepted by pdserve's own
command-line parsers. make_secrets.py's Secrets validate too and hold keys pdserve loads."""

from __future__ import annotations

import argparse
import base64
import importlib.util
import re
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.30.0"  # a version every current cluster serves the apps/v1 and v1 schemas of


def documents() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def container(deployment: dict) -> dict:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def pod_ip_args(c: dict) -> list[str]:
    """The container's arguments with $(POD_IP) and $(POD_NAME) as Kubernetes expands them."""
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env.get("POD_IP") == "status.podIP", env
    return [a.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAME)", "pdserve-x-1") for a in c["args"]]


def make_secrets_module():
    spec = importlib.util.spec_from_file_location("make_secrets", K8S / "make_secrets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_every_resource_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_a_deliberately_broken_resource_fails_validation():
    bad = by_kind("Deployment")["pdserve-router"]
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = {"no": "such"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(by_kind("Service")["pdserve-router"]))
    bad["spec"]["portz"] = bad["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_one_deployment_per_role_with_services_for_the_router():
    deps = by_kind("Deployment")
    roles = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: name
             for name, d in deps.items()}
    assert roles == {"router": "pdserve-router", "prefill": "pdserve-prefill", "decode": "pdserve-decode"}
    for d in deps.values():
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    router = deps["pdserve-router"]
    assert router["spec"]["replicas"] == 1
    router_ports = {p["name"]: p["containerPort"] for p in container(router)["ports"]}
    services = by_kind("Service")
    labels = router["spec"]["template"]["metadata"]["labels"]
    for name, port in (("pdserve-router", "http"), ("pdserve-register", "register")):
        svc = services[name]["spec"]
        assert svc["selector"].items() <= labels.items()
        [p] = svc["ports"]
        assert p["targetPort"] == port and port in router_ports
    # workers must reach the register port while the router is not ready yet (it is ready once they did)
    assert services["pdserve-register"]["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in services["pdserve-router"]["spec"]


def test_pod_ips_advertised_readiness_probes_and_arguments_pdserve_accepts():
    from pdserve.server.cli import add_router_arguments
    from pdserve.workers.cli import serve_parser

    deps = by_kind("Deployment")
    services = by_kind("Service")
    register = services["pdserve-register"]["spec"]["ports"][0]["port"]
    for name, d in deps.items():
        c = container(d)
        assert c["readinessProbe"], name
        probe = c["readinessProbe"].get("httpGet") or c["readinessProbe"].get("tcpSocket")
        assert probe["port"] in {p["name"] for p in c["ports"]}, name
        args = pod_ip_args(c)
        assert not any("0.0.0.0" in a for a in args), name
        if name == "pdserve-router":
            p = argparse.ArgumentParser(exit_on_error=False)
            add_router_arguments(p, register_default="tcp://127.0.0.1:7100")
            p.add_argument("--keys")
            assert c["command"] == ["pdserve", "router"]
            a = p.parse_args(args)
            assert (a.host, a.register) == ("10.1.2.3", f"tcp://10.1.2.3:{register}")
            assert a.keys == c["volumeMounts"][0]["mountPath"]
            assert any(e["name"] == "PDSERVE_API_KEY" and e["valueFrom"]["secretKeyRef"]["name"] == "pdserve-api-key"
                       for e in c["env"])
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        else:
            assert c["command"] == ["pdserve-worker"]
            a = serve_parser().parse_args(args)
            assert a.role == d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert a.control == "tcp://10.1.2.3:7201"
            assert a.router == f"tcp://pdserve-register:{register}"
            assert a.transport in ("nixl", "zmq")  # ipc is for one host
            assert a.keys == c["volumeMounts"][0]["mountPath"]
            if a.role == "decode":
                assert (a.kv_host, a.kv_port) == ("10.1.2.3", 7300)
                assert 7300 in {p["containerPort"] for p in c["ports"]}
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_curve_keys_are_secrets_and_a_worker_never_mounts_the_routers():
    mounted = {}
    for name, d in by_kind("Deployment").items():
        [vol] = d["spec"]["template"]["spec"]["volumes"]
        assert vol["secret"]["defaultMode"] == 0o400  # pdserve refuses secret key files others can read
        mounted[name] = vol["secret"]["secretName"]
    assert mounted == {"pdserve-router": "pdserve-router-keys", "pdserve-prefill": "pdserve-worker-keys",
                       "pdserve-decode": "pdserve-worker-keys"}


def test_make_secrets_writes_valid_secrets_that_pdserve_loads(tmp_path):
    from pdserve.settings.keys import load_router_keys, load_worker_keys

    docs = make_secrets_module().manifests(namespace="llm", api_key="k" * 48)
    assert [d["metadata"]["name"] for d in docs] == ["pdserve-router-keys", "pdserve-worker-keys", "pdserve-api-key"]
    for d in docs:
        kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
    folders = {}
    for d, sub in zip(docs[:2], ("router", "worker")):
        folder = tmp_path / sub
        folder.mkdir(mode=0o700)
        for fname, b64 in d["data"].items():
            path = folder / fname
            path.write_bytes(base64.b64decode(b64))
            path.chmod(0o400)  # as the Secret volume's defaultMode
        folders[sub] = folder
    assert set(docs[1]["data"]) == {"worker.key_secret", "router.key"}  # no router secret for workers
    router, worker = load_router_keys(folders["router"]), load_worker_keys(folders["worker"])
    assert router.worker_public == worker.worker.public and worker.router_public == router.router.public
    assert base64.b64decode(docs[2]["data"]["api-key"]) == b"k" * 48
    assert re.fullmatch(r"[0-9a-f]{48}", base64.b64decode(make_secrets_module().manifests()[2]["data"]["api-key"])
                        .decode())
