"""What GitOps tools read from a ProxyConfiguration, phase by phase, on the real objects.

The operator runs as a host process (its shipped RBAC) with --ipvs-policy=deny and a short
--rollout-deadline; the node simulator runs its agents from the agent image under runc on one
simulated node. A watch (from the resourceVersion of a list taken before the creation, so no
version is missed) records every version of the object, and every version is read by:

- kstatus as sigs.k8s.io/cli-utils computes it (the Go checker toolchain/kstatus builds),
- Flux's healthCheckExprs of examples/gitops/flux (cel-go, as Flux evaluates them),
- Argo CD's health check examples/gitops/argocd/health.lua (Debian's lua5.4),

which must agree with each other on every version, and say what each phase is: created,
rolling out, Ready, ipvs denied, recovered, a failing agent (an image no node can pull), and
recovered again.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gitops_health import HEALTH_LUA, Health, health
from operator_process import Operator, install, wait_until

from kpx_cluster.binaries import kubernetes_binary
from kpx_cluster.controlplane import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

REPO = Path(__file__).resolve().parents[2]
RUN = secrets.token_hex(3)
NAME = f"gitops-{RUN}"
LABEL = {"kpx.dev/e2e-gitops": RUN}
#: Longer than a healthy rollout on one simulated node takes here, short for the failing phase.
ROLLOUT_DEADLINE = 10
Obj = dict[str, Any]

#: What each tool says, for each kstatus verdict.
AGREE = {
    "Current": ("Current", "Healthy"),
    "InProgress": ("InProgress", "Progressing"),
    "Failed": ("Failed", "Degraded"),
}


class Versions:
    """Every version of one ProxyConfiguration, from a watch that starts at `resource_version`."""

    def __init__(self, cluster: Cluster, resource_version: str) -> None:
        path = (
            "/apis/proxy.kpx.dev/v1alpha1/proxyconfigurations?watch=1"
            f"&fieldSelector=metadata.name%3D{NAME}&resourceVersion={resource_version}"
        )
        self.proc = subprocess.Popen(
            [
                str(kubernetes_binary("kubectl")),
                f"--kubeconfig={cluster.kubeconfig}",
                "get",
                "--raw",
                path,
                "--request-timeout=0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.seen: list[Obj] = []
        self._cursor = 0  # where the next `wait` starts: after the version it last found
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["type"] in ("ADDED", "MODIFIED"):
                with self._lock:
                    self.seen.append(event["object"])

    def all(self) -> list[Obj]:
        with self._lock:
            return list(self.seen)

    def wait(self, check: Callable[[Obj], bool], what: str, timeout: float = 60) -> Obj:
        """The first version after the one the last `wait` found for which `check` holds."""

        def found() -> tuple[int, Obj] | None:
            seen = self.all()
            return next(
                ((i, o) for i, o in enumerate(seen) if i >= self._cursor and check(o)), None
            )

        index, obj = wait_until(found, timeout, what)
        self._cursor = index + 1
        return obj

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def cond(obj: Obj, type_: str) -> tuple[str, str]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c["status"], c["reason"]
    return ("", "")


def acted(obj: Obj) -> bool:
    """The operator's status is of the object's current generation."""
    st = obj.get("status") or {}
    return st.get("observedGeneration") == obj["metadata"]["generation"]


def reading(obj: Obj) -> tuple[str, str, str]:
    h = health(obj)
    return h.kstatus, h.cel, h.argocd


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    workdir = tmp_path_factory.mktemp("gitops-status")
    kubeconfig = install(cluster, workdir)
    flags = ("--ipvs-policy=deny", "--resync-interval=1", f"--rollout-deadline={ROLLOUT_DEADLINE}")
    op = Operator.start(kubeconfig, workdir / "operator.log", *flags)
    try:
        yield op
    finally:
        op.stop()
        cluster.kubectl(
            "patch",
            "proxyconfiguration",
            NAME,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
        cluster.kubectl(
            "delete", "proxyconfiguration", NAME, "--ignore-not-found", "--wait=false", check=False
        )
        cluster.kubectl(
            "-n",
            "kpx-system",
            "delete",
            f"daemonset/kpx-agent-{NAME}",
            f"configmap/kpx-agent-{NAME}",
            "--ignore-not-found",
            check=False,
        )


def test_the_argocd_cm_snippet_is_health_lua() -> None:
    cm = yaml.safe_load((REPO / "examples" / "gitops" / "argocd" / "argocd-cm.yaml").read_text())
    key = "resource.customizations.health.proxy.kpx.dev_ProxyConfiguration"
    assert cm["data"][key] == HEALTH_LUA.read_text()
    # The key names the CRD's real API group.
    crd = yaml.safe_load((REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml").read_text())
    assert key.endswith(f".{crd['spec']['group']}_{crd['spec']['names']['kind']}")


def test_phases_read_the_same_in_kstatus_flux_and_argocd(
    cluster: Cluster, operator: Operator
) -> None:
    from kpx_cluster.netns import Topology
    from kpx_cluster.nodesim import NodeSimulator
    from kpx_cluster.nodesim.runc import built_images

    try:
        store = built_images()
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)
    listed = json.loads(cluster.kubectl("get", "proxyconfigurations", "-o", "json").stdout)
    versions = Versions(cluster, listed["metadata"]["resourceVersion"])
    readings: dict[str, tuple[str, str, str]] = {}
    took: dict[str, float] = {}  # seconds from the start to each phase's version being read
    t0 = time.monotonic()

    def phase(name: str, obj: Obj, expected: tuple[str, str, str]) -> Health:
        h = health(obj)
        readings[name] = (h.kstatus, h.cel, h.argocd)
        took[name] = round(time.monotonic() - t0, 1)
        assert readings[name] == expected, f"{name}: {h} on {obj.get('status')}"
        return h

    def patch(spec: Obj) -> None:
        cluster.kubectl(
            "patch", "proxyconfiguration", NAME, "--type=merge", "-p", json.dumps({"spec": spec})
        )

    def ready(o: Obj) -> bool:
        return acted(o) and cond(o, "Ready")[0] == "True"

    with Topology() as topo:
        sim = NodeSimulator(cluster, topo, runtime="runc", images=store)
        try:
            sim.add_node(f"gitops-{RUN}", labels=LABEL)
            pxc = {
                "apiVersion": "proxy.kpx.dev/v1alpha1",
                "kind": "ProxyConfiguration",
                "metadata": {"name": NAME},
                "spec": {
                    "mode": "nftables",
                    "nodeSelector": LABEL,
                    # Leave the node's conntrack settings alone: the simulator's stand-in
                    # directories cannot take them (ConntrackNotApplied, which is Stalled).
                    "conntrack": {
                        "maxPerCore": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                },
            }
            cluster.kubectl("create", "-f", "-", input=json.dumps(pxc))

            # Created: the operator has written nothing yet. kstatus reads an object without
            # conditions as Current; the apiserver shows the CRD's default status instead
            # (Reconciling True, NotYetSeen, no observedGeneration).
            created = versions.wait(lambda o: True, "the created object")
            assert cond(created, "Reconciling") == ("True", "NotYetSeen")
            assert "observedGeneration" not in created["status"]
            phase("created", created, ("InProgress", "InProgress", "Progressing"))

            # The operator's first write, before any agent exists.
            first = versions.wait(lambda o: "observedGeneration" in o["status"], "first status")
            assert cond(first, "Reconciling") == ("True", "RollingOut")
            assert cond(first, "Ready") == ("False", "AgentsNotDeployed")
            assert first["status"]["observedGeneration"] == 1
            phase("first status", first, ("InProgress", "InProgress", "Progressing"))

            rolling = versions.wait(
                lambda o: (
                    acted(o)
                    and cond(o, "Reconciling")[0] == "True"
                    and cond(o, "Ready")[1] in ("AgentsNotReady", "RollingOut")
                ),
                "rolling out",
            )
            phase("rolling out", rolling, ("InProgress", "InProgress", "Progressing"))

            done = versions.wait(ready, "Ready", 90)
            assert cond(done, "Reconciling") == ("False", "Reconciled")
            assert cond(done, "Stalled") == ("False", "AsExpected")
            phase("ready", done, ("Current", "Current", "Healthy"))

            # ipvs, which this operator denies: nothing a retry can fix.
            patch({"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True}})
            denied = versions.wait(
                lambda o: acted(o) and cond(o, "Stalled")[0] == "True", "Stalled: ipvs denied"
            )
            assert cond(denied, "Stalled") == ("True", "IPVSDenied")
            h = phase("ipvs denied", denied, ("Failed", "Failed", "Degraded"))
            assert "--ipvs-policy=deny" in h.kstatus_message
            assert h.argocd_message.startswith("IPVSDenied: ")

            patch({"mode": "nftables", "ipvs": None})
            again = versions.wait(ready, "Ready again after ipvs", 90)
            phase("recovered from ipvs", again, ("Current", "Current", "Healthy"))

            # A failing agent: an image no node can pull. Rolling out at first, then Stalled
            # once the rollout is past --rollout-deadline.
            patch({"image": "registry.invalid/kpx-agent:missing"})
            stuck = versions.wait(
                lambda o: acted(o) and cond(o, "Stalled")[0] == "True",
                "Stalled: rollout deadline",
                ROLLOUT_DEADLINE + 30,
            )
            assert cond(stuck, "Stalled") == ("True", "RolloutDeadlineExceeded")
            assert cond(stuck, "Ready")[0] == "False"
            h = phase("failing agent", stuck, ("Failed", "Failed", "Degraded"))
            assert f"no progress for {ROLLOUT_DEADLINE}s" in h.kstatus_message
            before = versions.all()[: versions.all().index(stuck)]
            generation = stuck["metadata"]["generation"]
            assert any(
                cond(o, "Reconciling") == ("True", "RollingOut")
                and acted(o)
                and o["metadata"]["generation"] == generation
                for o in before
            ), "the failing rollout was never Reconciling first"

            patch({"image": None})
            recovered = versions.wait(ready, "Ready after the failing agent", 90)
            phase("recovered", recovered, ("Current", "Current", "Healthy"))
            assert sim.refused == []
        finally:
            versions.stop()
            sim.stop(delete_nodes=True)

    # Every version the watch saw reads the same in the three tools.
    seen = versions.all()
    for obj in seen:
        ks, cel, argo = reading(obj)
        assert (cel, argo) == AGREE[ks], (ks, cel, argo, obj["status"])
    print(f"\n{len(seen)} versions; phases: {readings}; seconds: {took}")
