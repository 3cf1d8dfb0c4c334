"""The Kubernetes manifests of ``deploy/k8s``, rendered offline by ``kubectl kustomize``.

No cluster: each overlay is rendered to objects and checked for what a cluster would rely on
(kinds and names, the ports the config and the command line name, the ``InferencePool``'s
picker reference, RBAC for discovery), and the ConfigMap is parsed by kvroute's own parser.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from kvroute.config import parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the "
                                "kustomize overlays cannot be rendered")


def _render(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _config_map(objs: dict[tuple[str, str], dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    (name, cm), = [(n, o) for (k, n), o in objs.items() if k == "ConfigMap"]
    return name, cm


def _container(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    spec = objs[("Deployment", "kvroute")]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return dict(container)


def _common(objs: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert {o["metadata"].get("namespace") for o in objs.values()} == {"llm"}
    pod = objs[("Deployment", "kvroute")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kvroute"
    binding = objs[("RoleBinding", "kvroute-discovery")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvroute", "namespace": "llm"}]
    rules = {(g, r): set(rule["verbs"]) for rule in objs[("Role", "kvroute-discovery")]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"list", "watch"} <= rules[("discovery.k8s.io", "endpointslices")]
    name, cm = _config_map(objs)
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == name  # the generated (hashed) name is wired through
    config = parse_config(yaml.safe_load(cm["data"]["kvroute.yaml"]), env={})
    container = _container(objs)
    assert container["args"][1:3] == ["-c", "/etc/kvroute/kvroute.yaml"]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/kvroute"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == config.listen.port
    assert config.listen.host == "0.0.0.0"  # reachable from the Service
    svc = {p["name"]: p for p in objs[("Service", "kvroute")]["spec"]["ports"]}
    assert svc["http"]["port"] == config.listen.port


def test_proxy_overlay_serves_openai_on_the_config_port() -> None:
    objs = _render("proxy")
    _common(objs)
    assert sorted(k for k, _ in objs) == ["ConfigMap", "Deployment", "Role", "RoleBinding",
                                          "Service", "ServiceAccount"]
    assert _container(objs)["args"][0] == "serve"


def test_epp_overlay_points_the_inference_pool_at_the_grpc_port() -> None:
    objs = _render("epp")
    _common(objs)
    container = _container(objs)
    args = container["args"]
    assert args[0] == "epp"
    grpc_port = int(args[args.index("--grpc-port") + 1])
    health_port = int(args[args.index("--health-port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["grpc-health"]) == (grpc_port, health_port)
    assert container["readinessProbe"] == {"grpc": {"port": health_port, "service": ""},
                                           "periodSeconds": 5}
    svc = {p["name"]: p for p in objs[("Service", "kvroute")]["spec"]["ports"]}
    assert svc["grpc"]["targetPort"] == "grpc"
    assert svc["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    pool = objs[("InferencePool", "vllm")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", "kvroute",
                                                                svc["grpc"]["port"])
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    assert pool["spec"]["selector"]["matchLabels"] and pool["spec"]["targetPorts"]


def test_the_config_reads_its_engines_from_the_namespace_it_is_deployed_in() -> None:
    objs = _render("epp")
    _, cm = _config_map(objs)
    config = parse_config(yaml.safe_load(cm["data"]["kvroute.yaml"]), env={})
    sources = [pool.kubernetes for pool in config.pools.values()]
    assert sources and all(s is not None for s in sources)
    deployed = objs[("Deployment", "kvroute")]["metadata"]["namespace"]
    assert {s.namespace for s in sources if s is not None} == {deployed}
    assert all(s.kubeconfig is None for s in sources if s is not None)  # in-cluster
    assert config.replicas() == []  # no engine is listed: all come from the API
