"""The reconcile pass and the deletion flow against an in-memory apiserver."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import MODES_WITH_BACKEND, Mode
from kpx_operator.admission import IPVSPolicy, PxcInfo
from kpx_operator.apiserver import ApiError, Applied
from kpx_operator.reconciler import NotYet, OperatorConfig, Reconciler

REPO = Path(__file__).resolve().parents[2]
NS = "kpx-system"
Key = tuple[str, str | None, str]


class FakeApi:
    """Objects by (kind, namespace, name); DaemonSets get the status in `ds_status`."""

    def __init__(self) -> None:
        self.objs: dict[Key, dict[str, Any]] = {}
        self.ds_status: dict[str, dict[str, Any]] = {}
        self.stuck: set[str] = set()  # DaemonSets whose foreground deletion does not finish
        self.statuses: list[dict[str, Any]] = []
        self.children_at_status: list[int] = []  # how many objects existed at each status write
        self.deletes: list[tuple[str, str, str]] = []
        self.refuse: ApiError | None = None
        self.lists: list[tuple[str, str, str]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []
        self.version = 0

    def _status(self, obj: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        if out["kind"] == "DaemonSet" and out["metadata"]["name"] in self.ds_status:
            out["status"] = {
                "observedGeneration": out["metadata"]["generation"],
                **self.ds_status[out["metadata"]["name"]],
            }
        return out

    async def apply(self, obj: Mapping[str, Any]) -> Applied:
        if self.refuse is not None:
            raise self.refuse
        meta = obj["metadata"]
        key = (str(obj["kind"]), meta.get("namespace"), str(meta["name"]))
        before = self.objs.get(key)
        new = copy.deepcopy(dict(obj))
        new.setdefault("metadata", {})
        unchanged = before is not None and {**before, "metadata": {}} == {**new, "metadata": {}}
        if before is not None and unchanged:
            return Applied(self._status(before), created=False)
        self.version += 1
        new["metadata"]["resourceVersion"] = str(self.version)
        new["metadata"]["generation"] = (before["metadata"]["generation"] + 1) if before else 1
        self.objs[key] = new
        return Applied(self._status(new), created=before is None)

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict[str, Any]]:
        self.lists.append((kind, label_selector, field_selector))
        wanted = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objs.items()
            if k == kind
            and ns == namespace
            and wanted.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        obj = self.objs.get((kind, namespace, name))
        return self._status(obj) if obj else None

    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, propagation: str = "Background"
    ) -> bool:
        key = (kind, namespace, name)
        if key not in self.objs:
            return False
        self.deletes.append((kind, name, propagation))
        if name in self.stuck:
            self.objs[key]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        else:
            del self.objs[key]
        return True

    async def patch_status(self, kind: str, name: str, status: Mapping[str, Any]) -> Any:
        self.statuses.append(dict(status))
        self.children_at_status.append(len(self.objs))
        return {}

    async def patch(
        self, kind: str, name: str, namespace: str | None, body: Mapping[str, Any]
    ) -> Any:
        """A JSON merge patch (null removes a key); a stale resourceVersion is a Conflict."""
        obj = self.objs.get((kind, namespace, name))
        if obj is None:
            raise ApiError(f"{kind} {name} not found")
        self.patches.append((kind, name, copy.deepcopy(dict(body))))
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want and want != obj["metadata"].get("resourceVersion"):
            raise ApiError("Conflict")

        def merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
            for key, value in patch.items():
                if value is None:
                    into.pop(key, None)
                elif isinstance(value, Mapping):  # RFC 7386: nulls of a new object drop too
                    if not isinstance(into.get(key), dict):
                        into[key] = {}
                    merge(into[key], value)
                else:
                    into[key] = copy.deepcopy(value)

        merge(obj, {k: v for k, v in body.items()})
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(obj)

    def hand_edit(self, kind: str, name: str) -> None:
        obj = self.objs[(kind, NS, name)]
        obj["metadata"]["generation"] += 1
        obj["metadata"]["resourceVersion"] = "edited"


class Events(list[tuple[str, str, str]]):
    def __call__(self, type_: str, reason: str, message: str) -> None:
        self.append((type_, reason, message))

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self]


def body(example: str = "proxyconfig.yaml", generation: int = 1, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    doc["metadata"].update(
        uid=f"uid-{doc['metadata']['name']}",
        generation=generation,
        creationTimestamp="2026-01-01T00:00:00Z",
    )
    doc["spec"].update(spec)
    return doc


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def clock() -> datetime:
    return datetime(2026, 1, 1, tzinfo=UTC)


def reconciler(api: FakeApi, **config: Any) -> Reconciler:
    return Reconciler(api, OperatorConfig(**config), clock=clock)


def kinds(api: FakeApi) -> set[tuple[str, str]]:
    return {(k, n) for k, _, n in api.objs}


AGENT_KINDS = {  # the agents' ServiceAccount and RBAC are installed with the operator
    ("ConfigMap", "kpx-agent-default"),
    ("DaemonSet", "kpx-agent-default"),
}


def conds(status: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_first_pass_writes_a_status_before_the_children_then_the_status() -> None:
    api, events = FakeApi(), Events()
    api.ds_status["kpx-agent-default"] = {"desiredNumberScheduled": 0}
    r, pxc = reconciler(api), body()
    status = run(r.reconcile(pxc, [], {}, events))
    assert kinds(api) == AGENT_KINDS
    assert events.reasons() == ["Created"] * 2
    # The first write comes before any child exists: kstatus reads Reconciling, not Current.
    assert len(api.statuses) == 2 and api.children_at_status[0] == 0
    first = conds(api.statuses[0])
    assert first["Reconciling"] == ("True", "RollingOut")
    assert first["Stalled"][0] == "False"
    assert first["Ready"] == ("False", "AgentsNotDeployed")
    assert api.statuses[0]["observedGeneration"] == 1
    assert status is not None
    assert status.condition("Ready").reason == "NoMatchingNodes"
    assert conds(api.statuses[1])["Reconciling"] == ("False", "Reconciled")
    # Same spec, stored status now current: nothing is written, nothing is said.
    pxc["status"] = api.statuses[-1]
    run(r.reconcile(pxc, [], {}, events))
    assert len(api.statuses) == 2 and len(events) == 2


def test_drift_is_repaired_and_reported() -> None:
    api, events = FakeApi(), Events()
    r, pxc = reconciler(api), body()
    run(r.reconcile(pxc, [], {}, events))
    api.hand_edit("DaemonSet", "kpx-agent-default")
    run(r.reconcile(pxc, [], {}, events))
    assert events[-1][:2] == ("Normal", "DriftRepaired")
    del api.objs[("DaemonSet", NS, "kpx-agent-default")]
    run(r.reconcile(pxc, [], {}, events))
    assert ("DaemonSet", "kpx-agent-default") in kinds(api)
    assert "Re-created DaemonSet kpx-system/kpx-agent-default" in events[-1][2]


def test_a_spec_change_is_an_update_not_drift() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api)
    run(r.reconcile(body(), [], {}, events))
    changed = body(generation=2, namespaceOptOut={"namespaces": ["x"]})
    run(r.reconcile(changed, [], {}, events))
    assert events[-1][:2] == ("Normal", "Updated")
    assert "ConfigMap" in events[-1][2] and "without restarting" in events[-1][2]


def test_denied_ipvs_removes_children_and_warns_once_per_generation() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api, ipvs_policy=IPVSPolicy.DENY)
    api.objs[("DaemonSet", NS, "kpx-agent-ipvs-pool")] = {
        "kind": "DaemonSet",
        "metadata": {"name": "kpx-agent-ipvs-pool", "generation": 1},
    }
    pxc = body("proxyconfig-ipvs.yaml")
    status = run(r.reconcile(pxc, [], {}, events))
    run(r.reconcile(pxc, [], {}, events))
    assert api.objs == {}
    assert events.reasons() == ["Deleted", "IPVSDenied"]
    assert status.condition("Degraded").reason == "IPVSDenied"
    run(r.reconcile(body("proxyconfig-ipvs.yaml", generation=2), [], {}, events))
    assert events.reasons()[-1] == "IPVSDenied"


def test_warn_policy_deploys_ipvs_with_a_warning_once_it_has_a_backend() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api, backends=frozenset(Mode))  # as when the agent has an ipvs backend
    status = run(r.reconcile(body("proxyconfig-ipvs.yaml"), [], {}, events))
    assert ("DaemonSet", "kpx-agent-ipvs-pool") in kinds(api)
    assert ("Warning", "DeprecatedMode") in [e[:2] for e in events]
    assert status.deprecated is True


@pytest.mark.parametrize("policy", [IPVSPolicy.ALLOW, IPVSPolicy.WARN])
def test_mode_without_a_backend_deploys_nothing_and_says_so(policy: IPVSPolicy) -> None:
    assert Mode.IPVS in MODES_WITH_BACKEND  # the gate today: test one without ipvs
    api, events = FakeApi(), Events()
    r = reconciler(api, ipvs_policy=policy, backends=frozenset({Mode.NFTABLES, Mode.IPTABLES}))
    api.objs[("DaemonSet", NS, "kpx-agent-ipvs-pool")] = {
        "kind": "DaemonSet",
        "metadata": {"name": "kpx-agent-ipvs-pool", "generation": 1},
    }
    pxc = body("proxyconfig-ipvs.yaml")
    status = run(r.reconcile(pxc, [], {}, events))
    run(r.reconcile(pxc, [], {}, events))
    assert api.objs == {}  # no DaemonSet (a stale one is removed), no ConfigMap, nothing
    assert events.reasons() == ["Deleted", "ModeNotImplemented"]
    (warning,) = [e for e in events if e[1] == "ModeNotImplemented"]
    assert warning[0] == "Warning" and "mode ipvs has no backend" in warning[2]
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ModeNotImplemented")
    assert status.condition("Ready").status == "False"
    assert status.mode is None and status.deprecated is True
    run(r.reconcile(body("proxyconfig-ipvs.yaml", generation=2), [], {}, events))
    assert events.reasons()[-1] == "ModeNotImplemented"  # again for the new generation


def test_refused_apply_is_reported_in_the_status() -> None:
    api, events = FakeApi(), Events()
    api.refuse = ApiError(403, "Forbidden", "daemonsets.apps is forbidden")
    status = run(reconciler(api).reconcile(body(), [], {}, events))
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ReconcileFailed")
    assert "forbidden" in degraded.message


def node_affinity_out(api: FakeApi, name: str = "kpx-agent-default") -> list[str]:
    """The nodes the agent DaemonSet's required node affinity keeps its Pods off."""
    pod = api.objs[("DaemonSet", NS, name)]["spec"]["template"]["spec"]
    terms = (
        ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    kept_out = [
        [
            v
            for f in t.get("matchFields") or []
            if f["key"] == "metadata.name" and f["operator"] == "NotIn"
            for v in f["values"]
        ]
        for t in terms
    ]
    assert all(k == kept_out[0] for k in kept_out)  # in every term (terms are ORed)
    return kept_out[0] if kept_out else []


def test_a_conflict_never_removes_running_agents_it_keeps_the_contested_nodes_out() -> None:
    """Issue #22: a new or relabelled node that an older configuration also selects used to
    cost the newer one its DaemonSet and ConfigMap (agents gone everywhere, no cleanup)."""
    api, events = FakeApi(), Events()
    r, pxc = reconciler(api), body()
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    run(r.reconcile(pxc, [], nodes, events))
    assert node_affinity_out(api) == []
    # An older configuration selects n1 too (it was relabelled).
    older = PxcInfo("aaa", "uid-aaa", "2025-01-01T00:00:00Z", "nftables", (("pool", "a"),))
    nodes["n1"] = {"pool": "a"}
    status = run(r.reconcile(pxc, [older], nodes, events))
    assert kinds(api) == AGENT_KINDS and not api.deletes
    assert node_affinity_out(api) == ["n1"]
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "NodeConflict")
    assert "node n1" in degraded.message and "ProxyConfiguration aaa" in degraded.message
    assert ("Warning", "NodeConflict") in [e[:2] for e in events]
    # The conflict ends: n1 comes back.
    nodes["n1"] = {}
    status = run(r.reconcile(pxc, [older], nodes, events))
    assert node_affinity_out(api) == [] and kinds(api) == AGENT_KINDS
    assert status.condition("Degraded").status == "False"


def test_an_orphaning_delete_leaves_the_agents_running() -> None:
    """Issue #22: deleting used to stop every agent and flush every node's rules at once. With
    spec.deletionPolicy Orphan (the default) nothing is stopped, deleted or cleaned."""
    api, events = FakeApi(), Events()
    r, pxc = reconciler(api), body()
    run(r.reconcile(pxc, [], {"n1": {}}, events))
    before = copy.deepcopy(api.objs)
    run(r.finalize(pxc, [], {"n1": {}}, 0, events))
    assert api.deletes == [] and api.objs == before
    assert kinds(api) == AGENT_KINDS  # no cleanup DaemonSet either
    # No ownerReference: no garbage collector cascade (Argo CD prunes with foreground
    # propagation) deletes them behind the operator's back.
    assert all("ownerReferences" not in o["metadata"] for o in api.objs.values())
    (said,) = [e for e in events if e[1] == "AgentsOrphaned"]
    assert "kpx-system/kpx-agent-default" in said[2]
    assert "proxy-agent cleanup --mode nftables" in said[2] and "Cleanup" in said[2]
    # The timer may still fire once: it changes nothing.
    run(r.reconcile(pxc, [], {"n1": {}}, events))
    assert api.objs == before


def agents_on(api: FakeApi, *nodes: str) -> None:
    for node in nodes:
        pod = agent_pod(f"u-{node}", node)
        api.objs[("Pod", NS, pod["metadata"]["name"])] = pod
        api.objs[("Node", None, node)] = {"kind": "Node", "metadata": {"name": node}}


def node_labels(api: FakeApi, node: str) -> dict[str, str]:
    return dict(api.objs[("Node", None, node)]["metadata"].get("labels") or {})


def agent_nodes(api: FakeApi) -> set[str]:
    return {
        o["spec"]["nodeName"]
        for (k, _, _), o in api.objs.items()
        if k == "Pod" and o["metadata"]["labels"]["app.kubernetes.io/name"] == "kpx-agent"
    }


def cleanup_pods_turn_ready(api: FakeApi) -> None:
    """What the cleanup DaemonSet does: a Ready Pod on each node it selects."""
    for (kind, _, name), node in list(api.objs.items()):
        if (
            kind == "Node"
            and (node["metadata"].get("labels") or {}).get("proxy.kpx.dev/cleanup") == "default"
        ):
            api.objs[("Pod", NS, f"kpx-cleanup-default-{name}")] = {
                "kind": "Pod",
                "metadata": {
                    "name": f"kpx-cleanup-default-{name}",
                    "namespace": NS,
                    "labels": {
                        "app.kubernetes.io/name": "kpx-cleanup",
                        "app.kubernetes.io/instance": "default",
                    },
                },
                "spec": {"nodeName": name},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }


def test_cleanup_goes_node_by_node_at_max_unavailable() -> None:
    """Issue #22: the cleanup DaemonSet used to run on every node at once (maxUnavailable
    100%). Now a node's agent stops and its rules go only when its turn comes; the others
    keep serving meanwhile."""
    api, events = FakeApi(), Events()
    pxc = body(deletionPolicy="Cleanup", maxUnavailable=1)
    r = reconciler(api)
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}, "n3": {}}
    run(r.reconcile(pxc, [], nodes, events))
    agents_on(api, "n1", "n2", "n3")
    order: list[str] = []  # nodes in the order their rules go
    for t in range(0, 40, 2):
        try:
            run(r.finalize(pxc, [], nodes, t, events))
        except NotYet:
            pass
        else:
            break
        if t == 0:  # the DaemonSet goes first, its Pods stay
            assert ("DaemonSet", "kpx-agent-default", "Orphan") in api.deletes
            cleanup = api.objs[("DaemonSet", NS, "kpx-cleanup-default")]
            selector = cleanup["spec"]["template"]["spec"]["nodeSelector"]
            assert selector == {"proxy.kpx.dev/cleanup": "default"}
        cleaning = [n for n in nodes if node_labels(api, n).get("proxy.kpx.dev/cleanup")]
        order += [n for n in cleaning if n not in order]
        # One node at a time without its agent, until it is clean.
        stopped = {"n1", "n2", "n3"} - agent_nodes(api)
        clean = {
            o["spec"]["nodeName"]
            for (k, _, n), o in api.objs.items()
            if k == "Pod" and n.startswith("kpx-cleanup-")
        }
        assert len(stopped - clean) <= 1, (t, stopped, clean)
        cleanup_pods_turn_ready(api)
    else:
        raise AssertionError("the cleanup did not finish")
    assert order == ["n1", "n2", "n3"]
    assert [n for n in nodes if node_labels(api, n)] == []  # its labels are removed
    assert not any(k in ("DaemonSet", "ConfigMap") for k, _, _ in api.objs)
    assert ("Normal", "CleanupDone") in [e[:2] for e in events]
    assert "3 node(s), 1 at a time" in next(e for e in events if e[1] == "CleanupDone")[2]


def test_cleanup_gives_up_after_no_progress_for_the_timeout() -> None:
    api, events = FakeApi(), Events()
    pxc = body(deletionPolicy="Cleanup", maxUnavailable=1)
    r = reconciler(api, cleanup_timeout=60)
    agents_on(api, "n1", "n2")
    never = agent_pod("u-pending", "")  # never scheduled: no node, no rules
    api.objs[("Pod", NS, never["metadata"]["name"])] = never
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    run(r.reconcile(pxc, [], nodes, events))
    for t in (0, 2):  # n1: agent stopped, then labelled for the cleanup
        with pytest.raises(NotYet):
            run(r.finalize(pxc, [], nodes, t, events))
    cleanup_pods_turn_ready(api)  # n1 clean; n2's cleanup Pod will never turn Ready
    for t in (4, 6, 8, 65):  # no progress since 6
        with pytest.raises(NotYet):
            run(r.finalize(pxc, [], nodes, t, events))
        if t == 6:
            cleanup_pods_turn_ready(api)  # only n1's
            del api.objs[("Pod", NS, "kpx-cleanup-default-n2")]
    run(r.finalize(pxc, [], nodes, 66, events))
    assert not any(k in ("DaemonSet", "ConfigMap") for k, _, _ in api.objs)
    assert agent_nodes(api) == set() and ("Pod", NS, never["metadata"]["name"]) not in api.objs
    assert node_labels(api, "n1") == {} and node_labels(api, "n2") == {}
    (warning,) = [e for e in events if e[0] == "Warning"]
    assert warning[1] == "CleanupTimedOut" and "1 of 2 node(s) clean" in warning[2]
    assert "stay on n2" in warning[2] and "its cleanup Pod is not Ready" in warning[2]


def test_the_nodes_of_orphaned_agents_are_kept_out_of_another_configuration() -> None:
    """deletionPolicy Orphan leaves agents running: a configuration created later (another
    name) that selects their nodes must not put a second agent there."""
    api, events = FakeApi(), Events()
    orphan = agent_pod("u-old", "n1")
    orphan["metadata"]["labels"]["app.kubernetes.io/instance"] = "old"
    api.objs[("Pod", NS, "kpx-agent-old-x")] = orphan
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    status = run(reconciler(api).reconcile(body(), [], nodes, events))
    assert node_affinity_out(api) == ["n1"]
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "NodeConflict")
    assert "node n1" in degraded.message and "old" in degraded.message
    assert "deletionPolicy Orphan" in degraded.message
    # Its own agents (the same instance, e.g. adopted after a re-creation) are no conflict.
    orphan["metadata"]["labels"]["app.kubernetes.io/instance"] = "default"
    status = run(reconciler(api).reconcile(body(), [], nodes, events))
    assert node_affinity_out(api) == [] and status.condition("Degraded").status == "False"


def test_cleanup_without_agents_left_cleans_the_selected_nodes() -> None:
    """The agents' DaemonSet was deleted by hand before the deletion: their rules stay on the
    nodes (a stopped agent leaves them), so the selected nodes are cleaned all the same."""
    api, events = FakeApi(), Events()
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    for node in nodes:
        api.objs[("Node", None, node)] = {"kind": "Node", "metadata": {"name": node}}
    pxc = body(deletionPolicy="Cleanup", maxUnavailable="100%")
    with pytest.raises(NotYet):
        run(reconciler(api).finalize(pxc, [], nodes, 0, events))
    assert [node_labels(api, n).get("proxy.kpx.dev/cleanup") for n in nodes] == ["default"] * 2
    # With its DaemonSet, the nodes are those its agents run on: here none (say, tainted).
    api, r = FakeApi(), reconciler(FakeApi())
    r.api = api
    for node in nodes:
        api.objs[("Node", None, node)] = {"kind": "Node", "metadata": {"name": node}}
    run(r.reconcile(pxc, [], nodes, events))
    run(r.finalize(pxc, [], nodes, 0, events))  # done at once: nothing to clean
    assert [node_labels(api, n) for n in nodes] == [{}, {}]
    assert not {k for k, _ in kinds(api)} & {"DaemonSet", "ConfigMap"}


def test_a_configuration_in_conflict_cleans_only_its_own_nodes() -> None:
    api, events = FakeApi(), Events()
    older = PxcInfo("aaa", "uid-aaa", "2025-01-01T00:00:00Z", "nftables", (("pool", "a"),))
    nodes = {"n1": {"pool": "a"}, "n2": {}}
    pxc = body(deletionPolicy="Cleanup", maxUnavailable="100%")
    run(reconciler(api).reconcile(pxc, [older], nodes, events))
    agents_on(api, "n2")  # the DaemonSet controller kept n1 out
    api.objs[("Node", None, "n1")] = {
        "kind": "Node",
        "metadata": {"name": "n1", "labels": nodes["n1"]},
    }
    with pytest.raises(NotYet):
        run(reconciler(api).finalize(pxc, [older], nodes, 0, events))
    assert node_labels(api, "n1") == {"pool": "a"}  # the older one's node: untouched
    assert node_labels(api, "n2") == {"proxy.kpx.dev/deleting": "default"}
    assert agent_nodes(api) == set()


def agent_pod(uid: str, node: str) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"kpx-agent-default-{uid}",
            "uid": uid,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/name": "kpx-agent",
                "app.kubernetes.io/instance": "default",
            },
        },
        "spec": {"nodeName": node},
    }


def node_state(pod_uid: str, node: str, not_applied: str) -> dict[str, Any]:
    return {
        "metadata": {"name": node},
        "status": {
            "mode": "nftables",
            "conntrackNotApplied": not_applied,
            "agentPod": {"name": f"p-{pod_uid}", "uid": pod_uid},
        },
    }


def test_conntrack_not_applied_on_a_node_is_degraded_until_its_agent_applies_it() -> None:
    api, events = FakeApi(), Events()
    api.ds_status["kpx-agent-default"] = {
        "desiredNumberScheduled": 2,
        "numberReady": 2,
        "updatedNumberScheduled": 2,
    }
    for uid, node in (("u1", "n1"), ("u2", "n2")):
        api.objs[("Pod", NS, uid)] = agent_pod(uid, node)
    failed = "conntrack settings not applied: nf_conntrack_max: cannot set 262144"
    api.objs[("ProxyNodeState", None, "n1")] = node_state(
        "u1", "n1", "nf_conntrack_max: cannot set 262144"
    )
    api.objs[("ProxyNodeState", None, "n2")] = node_state("u-old", "n2", "an old pod")
    r = reconciler(api)
    status = run(r.reconcile(body(), [], {}, events))
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ConntrackNotApplied")
    assert degraded.message == f"spec.conntrack is not applied on node n1: {failed}"
    assert status.condition("Ready").status == "True"  # the agents proxy all the same
    assert ("ProxyNodeState", "", "") in api.lists
    # The agent on n1 succeeds later: the condition clears.
    api.objs[("ProxyNodeState", None, "n1")] = node_state("u1", "n1", "")
    status = run(r.reconcile(body(), [], {}, events))
    assert (status.condition("Degraded").status, status.condition("Degraded").reason) == (
        "False",
        "AsExpected",
    )


def test_conntrack_left_alone_is_no_conntrack_problem() -> None:
    # The agents' reports are read all the same (preflight), but a ConntrackNotApplied from
    # before spec.conntrack left the node alone no longer degrades.
    api, events = FakeApi(), Events()
    api.objs[("Pod", NS, "u1")] = agent_pod("u1", "n1")
    api.objs[("ProxyNodeState", None, "n1")] = node_state("u1", "n1", "x")
    leave_alone = {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    status = run(reconciler(api).reconcile(body(conntrack=leave_alone), [], {}, events))
    assert status.condition("Degraded").reason == "AsExpected"
