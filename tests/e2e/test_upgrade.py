"""`helm upgrade` to another image tag moves the agents, node by node, with traffic answering.

The chart is installed on a 3-node simulated cluster (the operator runs as the chart's
Deployment on the simulated nodes), then upgraded from one image tag to another: the operator
takes the agents' image from its --agent-image (the chart's operator.agentImage), not from the
ProxyConfiguration, so the agents' DaemonSet rolls to the new image, one node at a time
(maxUnavailable 1, no surge), while a client keeps reaching a Service through its ClusterIP.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from agent_harness import wait_until as harness_wait_until
from test_chart_apiserver import CHART, REPO, Helm
from test_operator_cluster import _start_app

from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Pod, Topology
from kpx_cluster.nodesim import NodeSimulator
from kpx_cluster.nodesim.runc import built_images
from kpx_cluster.probe import probe

pytestmark = [pytest.mark.e2e, pytest.mark.netns]
T = TypeVar("T")
APP_NS = "e2e-cluster-app"
OLD, NEW = "0.1.0", "0.1.0-upgrade.1"
AGENT_REPO = "ghcr.io/kpx/kpx-agent"


def wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    return harness_wait_until(check, timeout, interval=0.5, message=what)  # type: ignore[arg-type]


@dataclass
class Upgrade:
    cluster: Cluster
    helm: Helm
    topo: Topology
    client: Pod
    namespace: str
    release: str
    pxc: str
    label: dict[str, str] = field(default_factory=dict)

    def json(self, *args: str) -> dict[str, Any]:
        out = self.cluster.kubectl(*args, "-o", "json", check=False)
        return dict(json.loads(out.stdout)) if out.returncode == 0 else {}

    def agents(self) -> dict[str, tuple[str, bool]]:
        """node -> (image, ready) of the agent pods that are not being deleted."""
        pods = self.json(
            "-n", self.namespace, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent"
        )
        out = {}
        for pod in pods.get("items", []):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            ready = any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pod.get("status", {}).get("conditions", [])
            )
            out[pod["spec"]["nodeName"]] = (pod["spec"]["containers"][0]["image"], ready)
        return out

    def ready(self) -> bool:
        pxc = self.json("get", "pxc", self.pxc)
        st = pxc.get("status", {})
        return (
            any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
            and st.get("observedGeneration") == pxc["metadata"]["generation"]
            and st.get("readyNodes") == 3
        )

    def vip(self) -> str:
        return str(self.json("-n", APP_NS, "get", "svc", "web")["spec"]["clusterIP"])


def _values(tag: str, label: dict[str, str], pxc: str) -> dict[str, Any]:
    return {
        "operator": {
            "replicas": 1,
            "image": {"tag": tag},
            "agentImage": {"tag": tag},
            "nodeSelector": label,
            "tolerations": [],
        },
        "proxyConfiguration": {"name": pxc, "keepOnUninstall": False},
        "agents": {"mode": "nftables", "common": {"nodeSelector": label}},
    }


@pytest.fixture(scope="module")
def upgrade(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upgrade]:
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-upgrade": run}
    namespace, release, pxc = f"kpx-upg-{run}", "kpx", f"upg-{run}"
    # The CRD as another module may have left it (applied from crds/, or kept by a release):
    # the install takes it over (--take-ownership), then owns and upgrades it.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    helm = Helm(cluster, tmp_path_factory.mktemp("helm-home"))
    cluster.create_namespace(namespace)
    with Topology() as topo:
        try:
            store = built_images()
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        for ref, archive in list(store.refs.items()):
            # The new tag: the same image, tagged again (as `docker tag` would).
            store.load(archive, f"{ref.rsplit(':', 1)[0]}:{NEW}")
        # The operator and the agents run from their images under runc, both tags.
        sim = NodeSimulator(cluster, topo, pod_apiserver_access=True, runtime="runc", images=store)
        try:
            nodes = [sim.add_node(f"u{run}-{i}", labels=label) for i in (1, 2, 3)]
            out = helm.run(
                "install",
                release,
                str(CHART),
                "--namespace",
                namespace,
                "--wait=false",
                "--take-ownership",
                values=_values(OLD, label, pxc),
            )
            assert out.returncode == 0, out.stderr
            _start_app(cluster, label)
            client = topo.add_pod(nodes[0], "client")
            yield Upgrade(cluster, helm, topo, client, namespace, release, pxc, label)
        finally:
            cluster.kubectl(
                "delete",
                "pxc",
                pxc,
                "--ignore-not-found",
                "--timeout=120s",
                check=False,
                timeout=150,
            )
            helm.run("uninstall", release, "--namespace", namespace, "--ignore-not-found")
            for args in (
                ("delete", "namespace", APP_NS, "--ignore-not-found", "--wait=false"),
                ("delete", "namespace", namespace, "--ignore-not-found", "--wait=false"),
            ):
                cluster.kubectl(*args, check=False, timeout=150)
            sim.stop(delete_nodes=True)


class Traffic(threading.Thread):
    """Probes the Service from the client pod until stopped; counts what failed."""

    def __init__(self, up: Upgrade, vip: str) -> None:
        super().__init__(daemon=True)
        self.up, self.vip = up, vip
        self.stopping = threading.Event()
        self.sent = self.failed = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            result = probe(self.up.topo, self.up.client, self.vip, 80, "tcp", count=4, timeout=1)
            self.sent += 4
            self.failed += result.failed
            time.sleep(0.2)


def test_helm_upgrade_rolls_agents_node_by_node_with_traffic_answering(upgrade: Upgrade) -> None:
    up = upgrade
    wait_until(up.ready, 180, f"{up.pxc} Ready on 3 nodes")
    before = wait_until(lambda: a if len(a := up.agents()) == 3 else None, 30, "3 agents")
    assert {image for image, _ in before.values()} == {f"{AGENT_REPO}:{OLD}"}
    wait_until(
        lambda: (
            up.json("-n", APP_NS, "get", "deploy", "web").get("status", {}).get("readyReplicas")
            == 3
        ),
        90,
        "app ready",
    )
    vip = up.vip()
    wait_until(
        lambda: probe(up.topo, up.client, vip, 80, "tcp", count=4, timeout=1).failed == 0,
        30,
        "traffic through the ClusterIP",
    )
    # The ProxyConfiguration stores no image: nothing pins the agents to the old one.
    assert "image" not in up.json("get", "pxc", up.pxc)["spec"]

    traffic = Traffic(up, vip)
    traffic.start()
    try:
        out = up.helm.run(
            "upgrade",
            up.release,
            str(CHART),
            "--namespace",
            up.namespace,
            values=_values(NEW, up.label, up.pxc),
        )
        assert out.returncode == 0, out.stderr
        # Watch the agents: record when each node first runs a Ready agent of the new image,
        # and never see more than one node without a Ready agent (maxUnavailable 1).
        moved: dict[str, float] = {}
        most_unready = 0
        deadline = time.monotonic() + 300
        while len(moved) < 3:
            assert time.monotonic() < deadline, f"agents did not all move: {up.agents()}"
            agents = up.agents()
            unready = 3 - sum(1 for _, ready in agents.values() if ready)
            most_unready = max(most_unready, unready)
            for node, (image, ready) in agents.items():
                if ready and image == f"{AGENT_REPO}:{NEW}" and node not in moved:
                    moved[node] = time.monotonic()
            time.sleep(0.3)
        wait_until(up.ready, 120, f"{up.pxc} Ready again")
    finally:
        traffic.stopping.set()
        traffic.join(timeout=30)

    assert most_unready <= 1, "more than one node was without a Ready agent at once"
    times = sorted(moved.values())
    assert times[1] - times[0] > 0.5 and times[2] - times[1] > 0.5, (
        f"agents moved together, not node by node: {moved}"
    )
    deploy = up.json("-n", up.namespace, "get", "deploy", "kpx-operator")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"ghcr.io/kpx/kpx-operator:{NEW}"
    )
    assert traffic.sent > 20, "the traffic probe hardly ran"
    assert traffic.failed == 0, f"{traffic.failed} of {traffic.sent} requests failed"
