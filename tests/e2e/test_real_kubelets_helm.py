"""The chart as users run it, on real kubelets (harness/kpx_cluster/kubelets, no kube-proxy):
`helm install` (the CRD from the chart's template, the ProxyConfiguration after it), the
operator and the agents from the project's images (imported into each node's containerd, never
pulled), `helm test` passing (its Pod, on a real kubelet: a Service answers through the agents,
the operator's Deployment and the ProxyConfiguration are Ready), `helm upgrade` to another image
tag rolling the operator and the agents node by node while a Service keeps answering from every
node (no failed request, never both agents unready at once), and after the documented
removal (deletionPolicy Cleanup, delete the ProxyConfiguration, `helm uninstall`) nothing of the
release is left: no object, no agent, no rule on the nodes (the operator's Lease, its own
record, may stay). `helm test` also fails, saying why, while the ProxyConfiguration is not Ready.

The new tag is the same images tagged again in each node's containerd (`ctr images tag`, as a
registry would serve a new release), so the roll exercises what an upgrade does to a node: a new
Pod of the agent replacing the old one over the rules it left in place.

Needs `make image` (or archives built for this work tree in $KPX_IMAGES_DIR) and root. About
2.5 minutes on a shared 2-core machine, with two nodes: marked `slow` (deselect with
-m 'not slow'), never skipped.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from test_real_kubelets_kpx import busybox_pod

from kpx_cluster.images import images, project_version
from kpx_cluster.kubelets import install
from kpx_cluster.kubelets.cluster import RealCluster
from kpx_cluster.kubelets.install import InstallFailed, get, wait_until
from kpx_cluster.netns import call_in_netns

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kpx"
NS = "kpx-system"
RELEASE = "kpx"
PXC = "default"
T = TypeVar("T")
#: Kinds the chart (and its test hook) makes, looked for after the uninstall.
NAMESPACED = (
    "deployments,daemonsets,pods,configmaps,serviceaccounts,roles,rolebindings,poddisruptionbudgets"
)
CLUSTER_WIDE = "clusterroles,clusterrolebindings,flowschemas,prioritylevelconfigurations"
#: The tag `helm upgrade` moves to (the release's images, tagged again on every node).
NEW_TAG = f"{project_version()}-upgrade.1"
APP = "upgrade-app"


def helm_binary() -> Path:
    go_mod = (REPO / "toolchain" / "helm" / "go.mod").read_text()
    pinned = re.search(r"^\s*(?:require\s+)?helm\.sh/helm/v3 (v\S+)$", go_mod, re.M)
    assert pinned is not None
    cache = Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))
    path = cache / "bin" / pinned.group(1) / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm is not built ({path} missing): run `make setup`", pytrace=False)
    return path


@pytest.fixture(scope="module")
def real() -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    try:
        install.archives("kpx")
    except install.InstallFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    with install.nodes_for("kpx", f"kpx-helm-{os.getpid()}", nodes=2) as rc:
        yield rc


@pytest.fixture(scope="module")
def helm(real: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    for name in ("CONFIG", "CACHE", "DATA"):
        env[f"HELM_{name}_HOME"] = str(home / name.lower())
    env["KUBECONFIG"] = str(real.cluster.kubeconfig)

    def run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(helm_binary()), *args], capture_output=True, text=True, env=env, timeout=timeout
        )

    return run


def tag_images_on_nodes(rc: RealCluster, tag: str) -> list[str]:
    """The release's images under `tag` in every node's containerd (what a registry serving
    that release would give the kubelet); the new references."""
    refs = [image.ref for image in images(project_version())]
    for plan in rc.plans.values():
        for ref in refs:
            subprocess.run(
                [
                    "ctr",
                    f"--address={plan.containerd_socket}",
                    "--namespace=k8s.io",
                    "images",
                    "tag",
                    "--force",
                    ref,
                    f"{ref.rsplit(':', 1)[0]}:{tag}",
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
    return [f"{ref.rsplit(':', 1)[0]}:{tag}" for ref in refs]


def web_app(rc: RealCluster) -> str:
    """A busybox web server on every node behind Service upgrade-app/web; its ClusterIP."""
    kubectl = rc.cluster.kubectl
    kubectl("create", "namespace", APP)
    pods = [
        busybox_pod(f"web-{node}", node, {"app": "web"}, serve=True, namespace=APP)
        for node in rc.node_names
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": APP},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    listing = {"apiVersion": "v1", "kind": "List", "items": [*pods, service]}
    kubectl("create", "-f", "-", input=json.dumps(listing))
    kubectl("wait", "-n", APP, "pods", "--all", "--for=condition=Ready", "--timeout=120s")
    return str(get(rc, "-n", APP, "service", "web")["spec"]["clusterIP"])


def http_status(ip: str, timeout: float = 2.0) -> str:
    """The status line of one HTTP request to ip:80 (from the calling thread's netns), or
    what went wrong."""
    try:
        with socket.create_connection((ip, 80), timeout=timeout) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return sock.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
    except OSError as exc:
        return repr(exc)


def answered(status: str) -> bool:
    """Whether an `http_status` is a 200 answer."""
    return status.split()[1:2] == ["200"]


def http_ok(ip: str) -> bool:
    return answered(http_status(ip))


class Traffic(threading.Thread):
    """Requests to the ClusterIP from every node's netns (as a host-network client there) until
    stopped; counts what failed."""

    def __init__(self, rc: RealCluster, vip: str) -> None:
        super().__init__(daemon=True)
        self.netns = [plan.netns for plan in rc.plans.values()]
        self.vip = vip
        self.stopping = threading.Event()
        self.sent = self.failed = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            for ns in self.netns:
                self.sent += 1
                self.failed += not call_in_netns(ns, lambda: http_ok(self.vip))
            time.sleep(0.1)


def agents_by_node(rc: RealCluster) -> dict[str, tuple[str, bool]]:
    """node -> (image, Ready) of the agents' Pods that are not being deleted. A Pod the
    DaemonSet just created has no node until the scheduler binds it: its node counts as one
    without an agent (left out) until then."""
    out = {}
    for pod in get(rc, "-n", NS, "pods", "-l", "app.kubernetes.io/name=kpx-agent")["items"]:
        if pod["metadata"].get("deletionTimestamp") or not pod["spec"].get("nodeName"):
            continue
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod.get("status", {}).get("conditions", [])
        )
        (agent,) = [c for c in pod["spec"]["containers"] if c["name"] == "agent"]
        out[pod["spec"]["nodeName"]] = (agent["image"], ready)
    return out


def upgrade_under_traffic(rc: RealCluster, helm: Callable[..., Any]) -> str:
    """`helm upgrade` to NEW_TAG while every node requests a Service: the agents move node by
    node, no request fails; what it took."""
    operator_ref, agent_ref = tag_images_on_nodes(rc, NEW_TAG)
    vip = web_app(rc)

    def answers() -> dict[str, str]:
        return {p.name: call_in_netns(p.netns, lambda: http_status(vip)) for p in rc.plans.values()}

    try:
        wait_until(
            lambda: all(answered(a) for a in answers().values()) or None,
            60,
            "the Service answering on every node",
        )
    except InstallFailed:
        raise AssertionError(f"{vip}:80 from each node: {answers()}") from None
    nodes = len(rc.plans)
    traffic = Traffic(rc, vip)
    traffic.start()
    started = time.monotonic()
    moved: dict[str, float] = {}
    most_unready = 0
    try:
        out = helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "--namespace",
            NS,
            "--reuse-values",
            "--set",
            f"operator.image.tag={NEW_TAG}",
            "--set",
            f"operator.agentImage.tag={NEW_TAG}",
        )
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 300
        while len(moved) < nodes:
            agents = agents_by_node(rc)
            assert time.monotonic() < deadline, f"the agents did not all move: {agents}"
            most_unready = max(most_unready, nodes - sum(ready for _, ready in agents.values()))
            for node, (image, ready) in agents.items():
                if ready and image == agent_ref and node not in moved:
                    moved[node] = time.monotonic()
            time.sleep(0.3)
        rc.cluster.kubectl("wait", f"pxc/{PXC}", "--for=condition=Ready", "--timeout=120s")
        rc.cluster.kubectl(
            "rollout", "status", "-n", NS, "deployment/kpx-operator", "--timeout=120s"
        )
        time.sleep(2)  # requests after the last agent moved count too
    finally:
        traffic.stopping.set()
        traffic.join(timeout=30)
    assert most_unready <= 1, "more than one node was without a Ready agent at once"
    first, last = min(moved.values()), max(moved.values())
    assert last - first > 0.5, f"the agents moved together, not node by node: {moved}"
    deploy = get(rc, "-n", NS, "deployment", "kpx-operator")
    images_now = {c["image"] for c in deploy["spec"]["template"]["spec"]["containers"]}
    assert images_now == {operator_ref}, images_now
    assert traffic.sent > 20, "the traffic hardly ran"
    assert traffic.failed == 0, f"{traffic.failed} of {traffic.sent} requests failed"
    rc.cluster.kubectl("delete", "namespace", APP, "--wait=false")
    return (
        f"helm upgrade: the last agent Ready on the new image {last - started:.1f} s after the "
        f"command, {traffic.sent} requests, none failed"
    )


def names(rc: RealCluster, kinds: str, *args: str) -> list[str]:
    out = rc.cluster.kubectl("get", kinds, *args, "-o", "name", check=False)
    return sorted(out.stdout.split())


def test_install_helm_test_and_uninstall(real: RealCluster, helm: Callable[..., Any]) -> None:
    kubectl = real.cluster.kubectl
    endpoint = real.cluster.cluster_server.removeprefix("https://")
    kubectl("create", "namespace", NS)
    kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=privileged")
    started = time.monotonic()
    out = helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NS,
        "--wait",
        "--timeout",
        "5m",
        "--set",
        f"operator.apiserverEndpoint={endpoint}",
        "--set",
        "agents.common.clusterCIDRs={10.244.0.0/16,fd00:244::/48}",
        "--set",
        "agents.logLevel=debug",
        # What `helm uninstall` then removes: the ProxyConfiguration goes first (Cleanup), and
        # without keep the CRD goes with the release.
        "--set",
        "proxyConfiguration.keepOnUninstall=false",
        "--set",
        "crds.keep=false",
        "--set",
        # How long the test Pod waits for Ready: the failing run below waits it out whole.
        "tests.timeoutSeconds=30",
    )
    assert out.returncode == 0, out.stderr
    installed = time.monotonic() - started
    # The agents run as the chart says: debug logs (--agent-arg=-v), metrics declared.
    agents = wait_until(
        lambda: get(real, "-n", NS, "pods", "-l", "app.kubernetes.io/name=kpx-agent")["items"],
        120,
        "the agents' pods",
    )
    (container,) = [c for c in agents[0]["spec"]["containers"] if c["name"] == "agent"]
    assert container["command"][-1] == "-v"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 10256, "metrics": 10249}
    # ... and /metrics answers on the node's address, not only on loopback (what Prometheus
    # scrapes), from the node's own network namespace (no host process dials a node).
    plan = next(iter(real.plans.values()))

    def metrics() -> str | None:
        got = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                plan.netns,
                "curl",
                "-sf",
                "--max-time",
                "3",
                f"http://{plan.ipv4}:10249/metrics",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        return got.stdout if got.returncode == 0 else None

    assert "# TYPE" in wait_until(metrics, 120, f"/metrics on {plan.ipv4}:10249")

    started = time.monotonic()
    tested = helm("test", RELEASE, "--namespace", NS, "--timeout", "5m")
    took = time.monotonic() - started
    assert tested.returncode == 0, tested.stdout + tested.stderr
    said = tested.stdout
    assert re.search(r"TEST SUITE:\s+kpx-test\n.*\n.*\nPhase:\s+Succeeded", said), said
    # A passed test leaves nothing (hook-delete-policy hook-succeeded).
    assert not [n for n in names(real, NAMESPACED, "-n", NS) if "kpx-test" in n]
    assert not [n for n in names(real, CLUSTER_WIDE) if "kpx-test" in n]

    upgraded = upgrade_under_traffic(real, helm)

    # The test fails when the ProxyConfiguration is not Ready (its agents kept off every node),
    # and its Pod then stays with the reason in its log.
    kubectl(
        "patch", "pxc", PXC, "--type=merge", "-p", '{"spec":{"nodeSelector":{"kpx.dev/none":"x"}}}'
    )
    failed = helm("test", RELEASE, "--namespace", NS, "--timeout", "5m")
    assert failed.returncode != 0, failed.stdout
    log = kubectl("logs", "-n", NS, "kpx-test").stdout
    assert "ok: a Service answers through the agents" in log, log
    assert f"ok: Deployment {NS}/kpx-operator is Ready" in log, log
    assert f"FAILED: ProxyConfiguration {PXC} is Ready: Ready=False" in log, log
    kubectl(
        "patch",
        "pxc",
        PXC,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/spec/nodeSelector/kpx.dev~1none"}]',
    )
    kubectl("wait", f"pxc/{PXC}", "--for=condition=Ready", "--timeout=120s")
    tested = helm("test", RELEASE, "--namespace", NS, "--timeout", "5m")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert not [n for n in names(real, NAMESPACED, "-n", NS) if "kpx-test" in n]
    assert not [n for n in names(real, CLUSTER_WIDE) if "kpx-test" in n]
    print(f"helm install --wait: {installed:.1f} s; helm test: {took:.1f} s; {upgraded}")

    # Removal as docs/helm.md says: Cleanup, delete the ProxyConfiguration, uninstall.
    kubectl("patch", "pxc", PXC, "--type=merge", "-p", '{"spec":{"deletionPolicy":"Cleanup"}}')
    kubectl("delete", "pxc", PXC, "--timeout=300s")
    out = helm("uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "5m")
    assert out.returncode == 0, out.stderr

    def left() -> list[str]:
        """What is left in the namespace but what every namespace has."""
        defaults = ("configmap/kube-root-ca.crt", "serviceaccount/default")
        return [n for n in names(real, NAMESPACED, "-n", NS) if n not in defaults]

    try:
        wait_until(lambda: not left(), 120, f"namespace {NS} empty")
    except InstallFailed:
        pods = kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
        raise AssertionError(f"left in {NS}: {left()}\n{pods}") from None
    assert names(real, CLUSTER_WIDE, "-l", "app.kubernetes.io/part-of=kpx") == []
    assert (
        names(
            real, "clusterroles,clusterrolebindings", "-l", f"app.kubernetes.io/instance={RELEASE}"
        )
        == []
    )
    gone = kubectl("get", "crd", "proxyconfigurations.proxy.kpx.dev", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    for role in ("kpx-agent-takeover", "kpx-operator-takeover"):
        assert (
            names(
                real,
                "roles,rolebindings",
                "-n",
                "kube-system",
                "--field-selector",
                f"metadata.name={role}",
            )
            == []
        )
    # The operator's Lease is the operator's own record, not the chart's: it may stay.
    assert not [
        n for n in names(real, "leases", "-n", NS) if n != "lease.coordination.k8s.io/kpx-operator"
    ]
    # No kpx rule on the node (the Cleanup removed them before the agents went).
    for plan in real.plans.values():
        tables = subprocess.run(
            ["ip", "netns", "exec", plan.netns, "nft", "list", "tables"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "kpx" not in tables, tables
