"""The local control plane is a real one: allocation, authorization and controllers work."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from kpx_cluster.binaries import KUBERNETES_VERSION
from kpx_cluster.controlplane import AlreadyRunning, Cluster

pytestmark = pytest.mark.e2e


def test_apiserver_is_the_pinned_release(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION


def test_namespace_and_service_get_a_cluster_ip(cluster: Cluster) -> None:
    cluster.kubectl("create", "namespace", "cp-alloc")
    cluster.kubectl("-n", "cp-alloc", "create", "service", "clusterip", "web", "--tcp=80:8080")
    ip = cluster.kubectl("-n", "cp-alloc", "get", "svc", "web", "-o", "jsonpath={.spec.clusterIP}")
    assert re.fullmatch(r"10\.96\.\d+\.\d+", ip.stdout), ip.stdout
    cidrs = cluster.kubectl("get", "servicecidrs", "-o", "jsonpath={.items[*].spec.cidrs}")
    assert "10.96.0.0/16" in cidrs.stdout


def test_authorization_is_enforced(cluster: Cluster, tmp_path: Path) -> None:
    nobody = cluster.client_kubeconfig("jane", (), tmp_path / "jane.kubeconfig")
    denied = cluster.kubectl("get", "secrets", "-A", kubeconfig=nobody, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr and "jane" in denied.stderr
    # ...and RBAC is what decides: once granted, the same user may read.
    cluster.kubectl("create", "clusterrole", "secret-reader", "--verb=list", "--resource=secrets")
    cluster.kubectl(
        "create", "clusterrolebinding", "jane-reads", "--clusterrole=secret-reader", "--user=jane"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if cluster.kubectl("get", "secrets", "-A", kubeconfig=nobody, check=False).returncode == 0:
            return
        time.sleep(0.2)
    pytest.fail("RBAC grant did not take effect")


def test_endpointslice_controller_runs(cluster: Cluster) -> None:
    cluster.create_namespace("cp-eps")
    # The controller skips Pods whose Node it cannot find.
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cp-node"}}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "cp-eps", "labels": {"app": "web"}},
        "spec": {"nodeName": "cp-node", "containers": [{"name": "c", "image": "web"}]},
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "cp-eps"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    # No kubelet: give the Pod an IP the way a kubelet would, through the status subresource.
    status = {
        "status": {
            "phase": "Running",
            "podIP": "10.244.9.9",
            "podIPs": [{"ip": "10.244.9.9"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    for obj in (node, pod, svc):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    try:
        cluster.kubectl(
            "-n",
            "cp-eps",
            "patch",
            "pod",
            "web-0",
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
        deadline = time.monotonic() + 30
        items: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            out = cluster.kubectl(
                "-n",
                "cp-eps",
                "get",
                "endpointslices",
                "-l",
                "kubernetes.io/service-name=web",
                "-o",
                "json",
            )
            items = json.loads(out.stdout)["items"]
            addresses = [a for s in items for e in s.get("endpoints") or [] for a in e["addresses"]]
            if "10.244.9.9" in addresses:
                labels = items[0]["metadata"]["labels"]  # type: ignore[index]
                assert labels["endpointslice.kubernetes.io/managed-by"] == (
                    "endpointslice-controller.k8s.io"
                )
                return
            time.sleep(0.5)
        pytest.fail(f"no EndpointSlice with the pod's address: {items}")
    finally:
        cluster.kubectl("delete", "node", "cp-node", "--wait=false")


def test_second_up_says_it_runs(cluster: Cluster) -> None:
    with pytest.raises(AlreadyRunning):
        Cluster(cluster.name, cluster.state_dir.parent).up()
    assert all(cluster.status().values())
