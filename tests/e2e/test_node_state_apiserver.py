"""ProxyNodeState against a real kube-apiserver (and its garbage collector): the agent's
writer with a ServiceAccount token bound to a Pod on node A writes A's object and is refused
B's by the shipped admission policy; a token bound to no Pod is refused any; the printer
columns answer mode, generation, agent version and last error; deleting the Node deletes its
ProxyNodeState (ownerReference)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_agent.observability.node_state import ErrorRecord, NodeFacts, SyncRecord
from kpx_agent.observability.node_state_writer import COLLECTION, NodeStateWriter
from kpx_agent.observability.pod_events import PodRef, event_body, post_event
from kpx_api.nodestate import LeftoverKind, LeftoverState, PendingLeftover, ProxyNodeStateStatus
from kpx_api.preflight import ModeCheck
from kpx_cluster.controlplane import Cluster
from kpx_cluster.kubeconfig import write_kubeconfig
from kpx_kube import Client, Forbidden, from_kubeconfig

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "proxynodestates.proxy.kpx.dev.yaml"
RUN = secrets.token_hex(3)
NS = f"pns-{RUN}"
PAUSE = "registry.k8s.io/pause:3.10"  # never runs: no kubelet serves these nodes


def _renamed(path: Path) -> list[dict[str, Any]]:
    """The shipped manifest's objects for this run: namespace kpx-system -> NS, cluster-scoped
    names suffixed (other tests install the real ones)."""
    text = path.read_text().replace("kpx-system", NS)
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        if "namespace" not in doc["metadata"]:
            doc["metadata"]["name"] += f"-{RUN}"
        if doc["kind"] == "ClusterRoleBinding":
            doc["roleRef"]["name"] += f"-{RUN}"
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            doc["spec"]["policyName"] += f"-{RUN}"
    return docs


@dataclass
class Env:
    cluster: Cluster
    tmp: Path
    nodes: tuple[str, str]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, input=input, check=check)

    def token_kubeconfig(self, bound_pod: str | None) -> Path:
        args = ["-n", NS, "create", "token", "kpx-agent"]
        if bound_pod:
            args += ["--bound-object-kind", "Pod", "--bound-object-name", bound_pod]
        token = self.kubectl(*args).stdout.strip()
        name = bound_pod or "unbound"
        (self.tmp / f"{name}.token").write_text(token)
        return write_kubeconfig(
            self.tmp / f"{name}.kubeconfig",
            server=self.cluster.server,
            ca=self.cluster.ca_file,
            user="kpx-agent",
            token_file=self.tmp / f"{name}.token",
        )

    def node_state(self, name: str) -> dict[str, Any] | None:
        out = self.kubectl("get", "proxynodestate", name, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def env(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/proxynodestates.proxy.kpx.dev"
    )
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kpx-agent", "namespace": NS},
        },
        *_renamed(REPO / "operator/manifests/agent-rbac.yaml"),
        *_renamed(REPO / "operator/manifests/agent-node-state-policy.yaml"),
    ]
    nodes = (f"pns-a-{RUN}", f"pns-b-{RUN}")
    for node in nodes:
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node},
                "status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]},
            }
        )
    docs = "\n---\n".join(
        yaml.safe_dump(o) for o in objs if o["metadata"].get("namespace") not in ("kube-system",)
    )
    cluster.kubectl("apply", "-f", "-", input=docs)
    for node in nodes:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"agent-{node}", "namespace": NS},
            "spec": {
                "nodeName": node,
                "serviceAccountName": "kpx-agent",
                "containers": [{"name": "agent", "image": PAUSE}],
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    env = Env(cluster, tmp_path_factory.mktemp("pns"), nodes)
    # The apiserver loads a new admission policy and its binding asynchronously: until a
    # dry-run create by an unbound token is refused, writes would pass unchecked.
    probe = json.dumps(
        {
            "apiVersion": "proxy.kpx.dev/v1alpha1",
            "kind": "ProxyNodeState",
            "metadata": {"name": f"pns-probe-{RUN}"},
        }
    )
    unbound = env.token_kubeconfig(None)
    dry_run = ("create", "--dry-run=server", "-f", "-")

    def refused() -> bool:
        out = cluster.kubectl(*dry_run, input=probe, check=False, kubeconfig=unbound)
        return "no node name in the token" in out.stderr

    wait_for(refused, 60, "the admission policy in force")
    yield env
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    for obj in objs:
        if not obj["metadata"].get("namespace") and obj["kind"] != "Namespace":
            cluster.kubectl(
                "delete",
                obj["kind"].lower()
                + (".admissionregistration.k8s.io" if "Admission" in obj["kind"] else ""),
                obj["metadata"]["name"],
                "--ignore-not-found",
                "--wait=false",
                check=False,
            )
    for node in nodes:
        cluster.kubectl("delete", "proxynodestate", node, "--ignore-not-found", check=False)


def facts(error: str = "") -> NodeFacts:
    now = datetime.now(UTC)
    return NodeFacts(
        mode="nftables",
        agent_version="0.1.0",
        pod=("agent", NS, "uid-1"),
        generation=3,
        verified=True,
        last_sync=SyncRecord(now, 0.25, True),
        services=12,
        endpoints=30,
        rules=140,
        last_error=ErrorRecord(error, now) if error else None,
        leftovers=(
            PendingLeftover(
                name="iptables",
                kind=LeftoverKind.KPX_MODE,
                message="the rules of kpx mode iptables not removed yet",
            ),
            PendingLeftover(
                name="kube-proxy",
                kind=LeftoverKind.KUBE_PROXY,
                state=LeftoverState.WAITING,
                message="kube-proxy runs here",
            ),
        ),
        takeover_from_kube_proxy=True,
        preflight=(
            ModeCheck("nftables", True, "nftables v1.0.6"),
            ModeCheck("ipvs", False, "ip_vs is not a module of 6.1"),
        ),
    )


def write(env: Env, kubeconfig: Path, node: str, error: str = "") -> NodeStateWriter:
    """One write of `node`'s state with the credentials of `kubeconfig` (the agent's code)."""

    async def run() -> NodeStateWriter:
        client = Client(from_kubeconfig(kubeconfig))
        uid = env.kubectl("get", "node", node, "-o", "jsonpath={.metadata.uid}").stdout
        writer = NodeStateWriter(client, node, lambda: facts(error), lambda: uid)
        try:
            await writer.write_once()
        finally:
            await client.close()
        return writer

    return asyncio.run(run())


def test_a_token_bound_to_a_pod_on_node_a_writes_a_and_is_refused_b(env: Env) -> None:
    a, b = env.nodes
    # The apiserver adds the node of a scheduled Pod to a token bound to it.
    bound = ("get", "pod", "-n", NS, f"agent-{a}", "-o", "jsonpath={.spec.nodeName}")
    wait_for(lambda: env.kubectl(*bound).stdout == a, 30, "pod bound")
    as_a = env.token_kubeconfig(f"agent-{a}")
    writer = write(env, as_a, a, error="mode nftables: Error: No such file or directory")
    assert (writer.writes, writer.failures) == (1, 0)
    obj = env.node_state(a)
    assert obj is not None
    status = ProxyNodeStateStatus.model_validate(obj["status"])
    assert (status.mode, status.configuration_generation, status.agent_version) == (
        "nftables",
        3,
        "0.1.0",
    )
    assert status.programmed is not None and status.programmed.rules == 140
    # What the operator reads for the takeover and Preflight, as the CRD keeps it.
    assert [(p.name, p.kind, p.state) for p in status.leftovers_pending] == [
        ("iptables", LeftoverKind.KPX_MODE, LeftoverState.PENDING),
        ("kube-proxy", LeftoverKind.KUBE_PROXY, LeftoverState.WAITING),
    ]
    assert status.takeover_from_kube_proxy
    assert [(v.mode, v.ok, v.detail) for v in status.preflight] == [
        ("nftables", True, "nftables v1.0.6"),
        ("ipvs", False, "ip_vs is not a module of 6.1"),
    ]
    assert obj["metadata"]["ownerReferences"][0]["kind"] == "Node"
    # The printer columns answer: which mode, generation, agent version, last error.
    table = env.kubectl("get", "proxynodestates", a).stdout
    header, row = table.splitlines()
    assert header.split()[:5] == ["NAME", "MODE", "GENERATION", "AGENT", "VERIFIED"]
    assert "LAST-ERROR" in header
    assert row.split()[:5] == [a, "nftables", "3", "0.1.0", "true"]
    assert row.endswith("mode nftables: Error: No such file or directory")

    # Node B's object, as the agent of node A: refused by the policy (RBAC allows it).
    writer = write(env, as_a, b)
    assert (writer.writes, writer.failures) == (0, 1)
    assert env.node_state(b) is None
    env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "proxy.kpx.dev/v1alpha1",
                "kind": "ProxyNodeState",
                "metadata": {"name": b},
            }
        ),
    )

    async def patch_b() -> None:
        client = Client(from_kubeconfig(as_a))
        try:
            await client.patch_status(f"{COLLECTION}/{b}", {"mode": "iptables"})
        finally:
            await client.close()

    with pytest.raises(Forbidden) as refused:
        asyncio.run(patch_b())
    assert f"kpx-agent on node {a} may write only ProxyNodeState {a}, not {b}" in str(refused.value)
    assert (env.node_state(b) or {}).get("status") is None

    # Node B's own agent writes B's.
    as_b = env.token_kubeconfig(f"agent-{b}")
    assert write(env, as_b, b).writes == 1
    assert (env.node_state(b) or {})["status"]["mode"] == "nftables"


def test_a_token_bound_to_no_pod_writes_nothing(env: Env) -> None:
    a, _ = env.nodes
    unbound = env.token_kubeconfig(None)

    async def patch() -> None:
        client = Client(from_kubeconfig(unbound))
        try:
            await client.patch_status(f"{COLLECTION}/{a}", {"mode": "iptables"})
        finally:
            await client.close()

    env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "proxy.kpx.dev/v1alpha1",
                "kind": "ProxyNodeState",
                "metadata": {"name": a},
            }
        ),
    )
    with pytest.raises(Forbidden) as refused:
        asyncio.run(patch())
    assert "no node name in the token" in str(refused.value)


def test_deleting_the_node_deletes_its_node_state(env: Env) -> None:
    """The agent's object names its Node as owner: the garbage collector deletes it."""
    node = f"pns-gone-{RUN}"
    env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}),
    )
    admin = env.cluster.kubeconfig
    writer = write(env, admin, node)
    assert writer.writes == 1 and env.node_state(node) is not None
    env.kubectl("delete", "node", node)
    wait_for(lambda: env.node_state(node) is None, 120, "the garbage collector")


def test_the_writer_coalesces_changes_to_one_write_per_period(env: Env) -> None:
    """The agent's writer loop: 30 changes 0.1 s apart with a 1 s period make at most one
    write per second of the busy window (plus one), at least 1 s apart, the last one holding
    the last change; syncs that change nothing but their time make none."""
    node = f"pns-busy-{RUN}"
    current = [facts()]

    async def run() -> tuple[int, float, list[float]]:
        client = Client(from_kubeconfig(env.cluster.kubeconfig))
        writer = NodeStateWriter(client, node, lambda: current[0], interval=1.0)
        times: list[float] = []
        wrote = writer.gate.wrote

        def noted(status: Any, now: float) -> None:
            times.append(now)
            wrote(status, now)

        writer.gate.wrote = noted  # type: ignore[method-assign]
        task = asyncio.create_task(writer.run())
        try:
            writer.poke()
            await asyncio.sleep(1.5)
            first = writer.writes
            started = time.monotonic()
            for i in range(30):
                current[0] = replace(current[0], endpoints=100 + i)
                writer.poke()
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)
            busy, window = writer.writes - first, time.monotonic() - started
            for _ in range(20):  # the same facts, newer syncs
                current[0] = replace(current[0], last_sync=SyncRecord(datetime.now(UTC), 0.1, True))
                writer.poke()
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.2)
            assert writer.writes - first == busy, "a sync that changes nothing was written"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
        return busy, window, times

    busy, window, times = asyncio.run(run())
    assert 3 <= busy <= int(window) + 1, (busy, window)
    assert min(b - a for a, b in itertools.pairwise(times)) >= 1.0
    obj = env.node_state(node)
    assert obj is not None and obj["status"]["programmed"]["endpoints"] == 129
    env.kubectl("delete", "proxynodestate", node)


def test_an_event_the_apiserver_refuses_is_logged_and_the_agent_goes_on(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's Events (pod_events.post_event) refused by the apiserver: by RBAC (a
    ServiceAccount without `create events`) and for a namespace that is gone. Each is logged
    with its reason and returns False, never raises; an allowed one is recorded."""
    a, _ = env.nodes
    uid = env.kubectl("get", "pod", "-n", NS, f"agent-{a}", "-o", "jsonpath={.metadata.uid}")
    pod = PodRef(f"agent-{a}", NS, uid.stdout)
    as_agent = env.token_kubeconfig(f"agent-{a}")
    env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "no-rights", "namespace": NS},
            }
        ),
    )
    (env.tmp / "no-rights.token").write_text(
        env.kubectl("-n", NS, "create", "token", "no-rights").stdout.strip()
    )
    no_rights = write_kubeconfig(
        env.tmp / "no-rights.kubeconfig",
        server=env.cluster.server,
        ca=env.cluster.ca_file,
        user="no-rights",
        token_file=env.tmp / "no-rights.token",
    )

    def post(kubeconfig: Path, pod: PodRef, reason: str) -> bool:
        async def run() -> bool:
            client = Client(from_kubeconfig(kubeconfig))
            try:
                body = event_body(pod, a, "Warning", reason, "a test", datetime.now(UTC))
                return await post_event(client, body)
            finally:
                await client.close()

        return asyncio.run(run())

    with caplog.at_level(logging.WARNING):
        assert not post(no_rights, pod, "RefusedByRBAC")
        assert not post(as_agent, replace(pod, namespace=f"gone-{RUN}"), "NamespaceGone")
        assert post(as_agent, pod, "Recorded")
    said = {r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()}
    assert any(
        m.startswith("event RefusedByRBAC not recorded") and "forbidden" in m.lower() for m in said
    ), said
    assert any(m.startswith("event NamespaceGone not recorded") for m in said), said
    reasons = env.kubectl("get", "events", "-n", NS, "-o", "jsonpath={.items[*].reason}")
    assert "Recorded" in reasons.stdout.split()
    assert "RefusedByRBAC" not in reasons.stdout.split()
