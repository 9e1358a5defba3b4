"""kpx as users run it, on real kubelets: no kube-proxy; the CRD, the operator's shipped
manifests (its Deployment from the project's image) and examples/proxyconfig.yaml applied with
kubectl; the operator makes the agents' DaemonSet, whose pods (the project's agent image,
imported into each node's containerd) program nftables in the node network namespaces; a
ClusterIP Service answers a client pod with both backends, on two nodes, and cluster DNS (CoreDNS
behind the kube-dns Service, through kpx) names it.

Needs `make image` (the archives are imported, never pulled).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest

from kpx_cluster.kubelets import install
from kpx_cluster.kubelets.cluster import RealCluster
from kpx_cluster.kubelets.install import get, wait_until
from kpx_cluster.kubelets.static_images import BUSYBOX_IMAGE

pytestmark = [pytest.mark.e2e, pytest.mark.netns]
NS = "kpx-system"
APP = "app"
T = TypeVar("T")


def busybox_pod(
    name: str, node: str, labels: dict[str, str], serve: bool, namespace: str = APP
) -> dict[str, Any]:
    """A busybox Pod on `node`: a web server on 8080 answering its hostname (Ready once it
    listens), or a client that sleeps."""
    script = (
        "mkdir -p /tmp/w && echo $HOSTNAME > /tmp/w/index.html && exec httpd -f -p 8080 -h /tmp/w"
        if serve
        else "exec sleep 3600"
    )
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
    }
    if serve:
        container["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


@pytest.fixture(scope="module")
def real() -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    try:
        install.archives("kpx")
    except install.InstallFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    with install.nodes_for("kpx", f"kpx-real-{os.getpid()}", nodes=2) as rc:
        yield rc


@pytest.fixture(scope="module")
def installed(real: RealCluster) -> RealCluster:
    """CRD, the operator's manifests and the example ProxyConfiguration (kubelets.install)."""
    install.install_kpx(real, "nftables")
    return real


def pxc_ready(rc: RealCluster) -> dict[str, Any] | None:
    return install.kpx_ready(rc, "nftables")


def test_the_operator_runs_the_agents_on_both_real_nodes(installed: RealCluster) -> None:
    status = wait_until(lambda: pxc_ready(installed), 180, "ProxyConfiguration Ready on 2 nodes")
    assert status["mode"] == "nftables"
    agents = get(installed, "-n", NS, "pods", "-l", "app.kubernetes.io/name=kpx-agent")["items"]
    assert sorted(p["spec"]["nodeName"] for p in agents) == ["node-1", "node-2"]
    for pod in agents:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["containers"][0]["image"].startswith("ghcr.io/kpx/kpx-agent:")
    # the agents' rules are in the node network namespaces (the agents are hostNetwork pods)
    for plan in installed.plans.values():
        tables = subprocess.run(
            ["ip", "netns", "exec", plan.netns, "nft", "list", "tables"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "table ip kpx" in tables, tables
    # no kube-proxy anywhere
    assert not [
        p for p in get(installed, "pods", "-A")["items"] if "kube-proxy" in p["metadata"]["name"]
    ]


def test_a_cluster_ip_service_answers_a_pod_from_backends_on_both_nodes(
    installed: RealCluster,
) -> None:
    wait_until(lambda: pxc_ready(installed), 180, "ProxyConfiguration Ready on 2 nodes")
    rc = installed
    rc.cluster.create_namespace(APP)
    pods = [busybox_pod(f"web-{n}", n, {"app": "web"}, serve=True) for n in rc.node_names]
    pods.append(busybox_pod("client", "node-1", {"app": "client"}, serve=False))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": APP},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    rc.cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [*pods, service]}),
    )

    def all_ready() -> bool:
        items = get(rc, "-n", APP, "pods")["items"]
        return len(items) == 3 and all(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            )
            for p in items
        )

    wait_until(all_ready, 90, "the backends and the client Ready")
    vip = get(rc, "-n", APP, "svc", "web")["spec"]["clusterIP"]
    seen: set[str] = set()

    def both_backends_answer() -> bool:
        got = rc.cluster.kubectl(
            "-n",
            APP,
            "exec",
            "client",
            "--",
            "timeout",
            "5",
            "wget",
            "-qO-",
            f"http://{vip}/",
            check=False,
        )
        if got.returncode == 0:
            seen.add(got.stdout.strip())
        return seen == {"web-node-1", "web-node-2"}

    wait_until(both_backends_answer, 60, f"both backends through {vip}:80 (seen {seen})")


def test_cluster_dns_names_the_service_through_kpx(installed: RealCluster) -> None:
    """The pod's resolver is the kube-dns Service (10.96.0.10), which kpx proxies to CoreDNS:
    the Service's name resolves to its ClusterIP."""
    rc = installed
    vip = get(rc, "-n", APP, "svc", "web")["spec"]["clusterIP"]

    def resolved() -> str | None:
        got = rc.cluster.kubectl(
            "-n", APP, "exec", "client", "--", "nslookup", "web.app.svc.cluster.local", check=False
        )
        return got.stdout if got.returncode == 0 and vip in got.stdout else None

    wait_until(resolved, 30, f"web.app.svc.cluster.local -> {vip}")
