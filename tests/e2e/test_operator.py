"""proxy-operator against a real apiserver, with exactly the RBAC it ships.

The operator runs as a host process with a token of its own ServiceAccount (operator/manifests),
so a permission it lacks fails here (its image under runc, running as the shipped Deployment
with exactly that RBAC, is test_operator_cluster.py). There is no kubelet for most tests: the
agent pods never run, so the status can only say "rolling out"; the last test adds the node
simulator, which runs the agents and the cleanup pods from the agent image under runc.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from kpx_api import MODES_WITH_BACKEND, agent_config_from_spec, parse_agent_config, parse_spec
from kpx_cluster.controlplane import Cluster, free_port
from kpx_cluster.kubeconfig import write_kubeconfig
from kpx_operator.builders import AGENT_RULES

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
MANIFESTS = REPO / "operator" / "manifests"
EXAMPLES = REPO / "examples"
NS = "kpx-system"
NODE = "op-e2e-node"  # labelled kpx.dev/pool=b: selected by "default" and by "e2e-pool-b"
OUR_PXCS = ("default", "ipvs-pool", "e2e-pool-b", "e2e-empty", "e2e-killed", "e2e-fenced")

T = TypeVar("T")
Obj = dict[str, Any]


def wait_until(check: Callable[[], T | None], timeout: float = 30, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last: {value!r})")
        time.sleep(0.25)


@dataclass
class Operator:
    """One proxy-operator process."""

    proc: subprocess.Popen[bytes]
    health_port: int
    log: Path
    metrics_port: int = 0

    def health(self) -> Obj | None:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return dict(json.loads(resp.read()))
        except OSError:
            return None

    def is_leader(self) -> bool:
        return bool((self.health() or {}).get("leader"))

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Env:
    cluster: Cluster
    kubeconfig: Path
    workdir: Path
    operators: list[Operator] = field(default_factory=list)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        return self.cluster.kubectl(*args, input=input, check=check)

    def get(self, kind: str, name: str, ns: str | None = None) -> Obj | None:
        args = ["get", kind, name, "-o", "json", "--show-managed-fields"]
        if ns:
            args[1:1] = ["-n", ns]
        result = self.kubectl(*args, check=False)
        return dict(json.loads(result.stdout)) if result.returncode == 0 else None

    def apply(self, obj: Obj) -> None:
        self.kubectl(
            "apply", "--server-side", "--field-manager=kpx-e2e", "-f", "-", input=json.dumps(obj)
        )

    def start_operator(self, *flags: str, kubeconfig: Path | None = None) -> Operator:
        port, metrics_port = free_port(), free_port()
        log = self.workdir / f"operator-{len(self.operators)}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / d) for d in ("operator", "api", "kube")]
                + [os.environ.get("PYTHONPATH", "")]
            ),
        }
        env.pop("KUBECONFIG", None)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kpx_operator",
                    "--namespace",
                    NS,
                    "--kubeconfig",
                    str(kubeconfig or self.kubeconfig),
                    "--health-address",
                    f"127.0.0.1:{port}",
                    "--metrics-address",
                    f"127.0.0.1:{metrics_port}",
                    "--resync-interval",
                    "2",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        op = Operator(proc, port, log, metrics_port)
        self.operators.append(op)
        wait_until(op.health, 20, f"operator health endpoint (log: {log})")
        return op

    def events(self, pxc: str) -> list[Obj]:
        out = self.kubectl(
            "-n", NS, "get", "events", "-o", "json", f"--field-selector=involvedObject.name={pxc}"
        ).stdout
        return list(json.loads(out)["items"])

    def reasons(self, pxc: str) -> set[tuple[str, str]]:
        return {(e["type"], e["reason"]) for e in self.events(pxc)}

    def condition(self, pxc: str, type_: str) -> Obj | None:
        obj = self.get("proxyconfiguration", pxc) or {}
        conds = (obj.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == type_), None)


def _manifest(name: str) -> str:
    return str(MANIFESTS / name)


@pytest.fixture(scope="module")
def env(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("operator")
    # Both CRDs: the agents report on their nodes in ProxyNodeStates (the operator reads them).
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE.parent))

    def established() -> bool:
        for crd in ("proxyconfigurations.proxy.kpx.dev", "proxynodestates.proxy.kpx.dev"):
            out = cluster.kubectl("get", "crd", crd, "-o", "json")
            conds = (json.loads(out.stdout).get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                return False
        return True

    wait_until(established, 60, "CRDs established")
    cluster.wait_namespace_settled(NS)  # an earlier module may have deleted it
    # Everything the operator ships except its Deployment (no kubelet here to run it).
    for name in (
        "namespace.yaml",
        "serviceaccount.yaml",
        "rbac.yaml",
        "agent-rbac.yaml",
        "agent-node-state-policy.yaml",
    ):
        cluster.kubectl("apply", "-f", _manifest(name))
    token = cluster.kubectl("-n", NS, "create", "token", "kpx-operator", "--duration=2h")
    token_file = workdir / "operator.token"
    token_file.write_text(token.stdout.strip())
    kubeconfig = write_kubeconfig(
        workdir / "operator.kubeconfig",
        server=cluster.server,
        ca=cluster.ca_file,
        user="system:serviceaccount:kpx-system:kpx-operator",
        token_file=token_file,
    )
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kpx.dev/pool": "b"}},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))
    e = Env(cluster, kubeconfig, workdir)
    try:
        yield e
    finally:
        for op in e.operators:
            op.stop()
        for name in OUR_PXCS:  # no operator left to release the finalizers
            cluster.kubectl(
                "patch",
                "proxyconfiguration",
                name,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
            cluster.kubectl(
                "delete",
                "proxyconfiguration",
                name,
                "--ignore-not-found",
                "--wait=false",
                check=False,
            )
        cluster.kubectl("delete", "node", NODE, "--ignore-not-found", "--wait=false", check=False)
        for name in ("rbac.yaml", "agent-rbac.yaml", "agent-node-state-policy.yaml"):
            cluster.kubectl(
                "delete", "-f", _manifest(name), "--ignore-not-found", "--wait=false", check=False
            )
        cluster.kubectl(
            "delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False
        )


@pytest.fixture(scope="module")
def leader(env: Env) -> Operator:
    """The first replica, with --ipvs-policy=deny; it takes the Lease."""
    op = env.start_operator("--ipvs-policy=deny")
    wait_until(op.is_leader, 20, "first operator leads")
    return op


def example(name: str) -> Obj:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


def pxc_body(name: str, **spec: Any) -> Obj:
    return {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": name},
        "spec": spec,
    }


CHILDREN = (  # the agents' ServiceAccount and RBAC (kpx-agent) are installed with the operator
    ("configmap", "kpx-agent-default", NS),
    ("daemonset", "kpx-agent-default", NS),
)


def test_children_appear_unowned_and_server_side_applied(env: Env, leader: Operator) -> None:
    env.apply(example("proxyconfig.yaml"))
    wait_until(lambda: env.get("daemonset", "kpx-agent-default", NS), 30, "agent DaemonSet")
    pxc = env.get("proxyconfiguration", "default")
    assert pxc is not None
    assert "proxy.kpx.dev/cleanup" in pxc["metadata"]["finalizers"]
    for kind, name, ns in CHILDREN:
        obj = env.get(kind, name, ns)
        assert obj is not None, (kind, name)
        # No ownerReference: only the finalizer (spec.deletionPolicy) decides their fate.
        assert "ownerReferences" not in obj["metadata"], (kind, obj["metadata"])
        # Nor app.kubernetes.io/instance: an Argo CD Application tracking by label would
        # take an object without owner that carries it for its own (test_gitops_kustomization).
        assert obj["metadata"]["labels"]["proxy.kpx.dev/configuration"] == "default"
        assert "app.kubernetes.io/instance" not in obj["metadata"]["labels"]
        managers = {(m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
        assert ("kpx-operator", "Apply") in managers, (kind, managers)
    cm = env.get("configmap", "kpx-agent-default", NS)
    assert cm is not None
    config = parse_agent_config(yaml.safe_load(cm["data"]["config.yaml"]))
    assert config == agent_config_from_spec(parse_spec(pxc["spec"]))
    role = env.get("clusterrole", "kpx-agent")
    assert role is not None and role["rules"] == list(AGENT_RULES)
    for kind, ns in (("serviceaccount", NS), ("clusterrole", None), ("clusterrolebinding", None)):
        assert env.get(kind, "kpx-agent-default", ns) is None, kind  # none per configuration
    ds = env.get("daemonset", "kpx-agent-default", NS)
    assert ds is not None
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "kpx-agent"
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["proxy-agent", "--mode", "nftables"]


def test_status_has_generation_and_conditions(env: Env, leader: Operator) -> None:
    def status() -> Obj | None:
        pxc = env.get("proxyconfiguration", "default") or {}
        st = pxc.get("status") or {}
        gen = pxc.get("metadata", {}).get("generation")
        ok = st.get("observedGeneration") == gen and st.get("desiredNodes", 0) >= 1
        return {**st, "generation": gen} if ok else None

    st = wait_until(status, 30, "status with observedGeneration and a desired node")
    conds = {c["type"]: c for c in st["conditions"]}
    assert set(conds) == {
        "Ready",
        "Progressing",
        "Degraded",
        "Deprecated",
        "Reconciling",
        "Stalled",
    }
    assert all(c["observedGeneration"] == st["generation"] for c in conds.values())
    # No kubelet: the agent pod never runs (kstatus: InProgress, not Current).
    assert (conds["Ready"]["status"], conds["Progressing"]["status"]) == ("False", "True")
    assert conds["Progressing"]["reason"] == "RollingOut"
    reconciling = conds["Reconciling"]
    assert (reconciling["status"], reconciling["reason"]) == ("True", "RollingOut")
    assert conds["Stalled"]["status"] == "False"
    assert conds["Deprecated"]["status"] == "False"
    assert (st["mode"], st["deprecated"], st["readyNodes"]) == ("nftables", False, 0)
    assert "kopf" in st  # kopf's bookkeeping is kept in status.kopf, not in annotations
    # ...and it is small: a digest of what was handled, never a copy of the spec.
    assert "last-handled-configuration" not in st["kopf"]
    assert str(st["kopf"].get("last-handled-digest", "")).startswith("sha256:")
    assert "nftables" not in json.dumps(st["kopf"])
    annotations = (env.get("proxyconfiguration", "default") or {})["metadata"].get("annotations")
    assert not any("kopf" in k for k in annotations or {})


def test_deleted_daemonset_comes_back(env: Env, leader: Operator) -> None:
    before = env.get("daemonset", "kpx-agent-default", NS)
    assert before is not None
    env.kubectl("-n", NS, "delete", "daemonset", "kpx-agent-default", "--wait=false")

    def recreated() -> bool:
        ds = env.get("daemonset", "kpx-agent-default", NS)
        return ds is not None and ds["metadata"]["uid"] != before["metadata"]["uid"]

    wait_until(recreated, 30, "DaemonSet re-created")
    wait_until(lambda: ("Normal", "DriftRepaired") in env.reasons("default"), 10, "event")


def test_hand_edited_daemonset_is_restored(env: Env, leader: Operator) -> None:
    env.kubectl("-n", NS, "set", "image", "daemonset/kpx-agent-default", "agent=evil:1")

    def image() -> str:
        ds = env.get("daemonset", "kpx-agent-default", NS) or {}
        return str(ds["spec"]["template"]["spec"]["containers"][0]["image"])

    wait_until(lambda: image() == "ghcr.io/kpx/kpx-agent:0.1.0", 30, "image restored")


def test_live_change_updates_the_configmap_and_not_the_pods(env: Env, leader: Operator) -> None:
    ds = env.get("daemonset", "kpx-agent-default", NS)
    assert ds is not None
    patch = {"spec": {"namespaceOptOut": {"namespaces": ["legacy-proxy", "e2e-opted-out"]}}}
    env.kubectl("patch", "proxyconfiguration", "default", "--type=merge", "-p", json.dumps(patch))

    def config_has_it() -> bool:
        cm = env.get("configmap", "kpx-agent-default", NS) or {}
        return "e2e-opted-out" in cm.get("data", {}).get("config.yaml", "")

    wait_until(config_has_it, 30, "ConfigMap updated")
    after = env.get("daemonset", "kpx-agent-default", NS)
    assert after is not None
    assert after["metadata"]["generation"] == ds["metadata"]["generation"]
    assert after["spec"]["template"] == ds["spec"]["template"]

    # A new image needs new pods: the template changes and the DaemonSet rolls.
    env.kubectl(
        "patch",
        "proxyconfiguration",
        "default",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"image": "ghcr.io/kpx/kpx-agent:0.1.1"}}),
    )

    def rolled() -> bool:
        new = env.get("daemonset", "kpx-agent-default", NS) or {"metadata": {"generation": 0}}
        return bool(new["metadata"]["generation"] > ds["metadata"]["generation"])

    wait_until(rolled, 30, "DaemonSet template changed")


def test_denied_ipvs_deploys_nothing(env: Env, leader: Operator) -> None:
    env.apply(example("proxyconfig-ipvs.yaml"))
    degraded = wait_until(lambda: env.condition("ipvs-pool", "Degraded"), 30, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "IPVSDenied")
    assert "nftables" in degraded["message"] and "deny" in degraded["message"]
    deprecated = env.condition("ipvs-pool", "Deprecated")
    assert deprecated is not None and deprecated["status"] == "True"
    pxc = env.get("proxyconfiguration", "ipvs-pool") or {}
    assert pxc["status"]["deprecated"] is True
    for kind in ("daemonset", "configmap"):
        assert env.get(kind, "kpx-agent-ipvs-pool", NS) is None, kind
    wait_until(lambda: ("Warning", "IPVSDenied") in env.reasons("ipvs-pool"), 10, "event")


def test_overlapping_node_selectors_are_a_conflict(env: Env, leader: Operator) -> None:
    env.apply(
        pxc_body(
            "e2e-pool-b",
            mode="nftables",
            nodeSelector={"kpx.dev/pool": "b"},
            deletionPolicy="Cleanup",
        )
    )

    def conflict(name: str) -> Obj | None:
        cond = env.condition(name, "Degraded")
        ok = cond and cond["reason"] == "NodeConflict" and NODE in cond["message"]
        return cond if ok else None

    newer = wait_until(lambda: conflict("e2e-pool-b"), 30, "newer Degraded")
    older = wait_until(lambda: conflict("default"), 30, "older Degraded")
    assert f"keeps its agents off node {NODE}" in newer["message"], newer
    assert "this one keeps its agents" in older["message"], older
    assert env.get("daemonset", "kpx-agent-default", NS) is not None  # the older one runs
    # Issue #22: the newer one keeps its DaemonSet and ConfigMap (agents on its other nodes
    # would keep running); the DaemonSet controller keeps its Pods off the contested node.
    ds = wait_until(lambda: env.get("daemonset", "kpx-agent-e2e-pool-b", NS), 30, "newer's DS")
    assert env.get("configmap", "kpx-agent-e2e-pool-b", NS) is not None
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [NODE]}]}
    ]
    # The DaemonSet controller agrees: no node for it.
    wait_until(
        lambda: ((env.get("daemonset", "kpx-agent-e2e-pool-b", NS) or {}).get("status") or {}).get(
            "observedGeneration"
        ),
        30,
        "DS observed",
    )
    ds = env.get("daemonset", "kpx-agent-e2e-pool-b", NS) or {}
    assert ds["status"].get("desiredNumberScheduled", 0) == 0, ds["status"]
    # Deleting the newer one (its cleanup keeps off the contested node) clears the conflict.
    env.kubectl("delete", "proxyconfiguration", "e2e-pool-b", "--timeout=30s")
    wait_until(
        lambda: (env.condition("default", "Degraded") or {}).get("status") == "False",
        30,
        "conflict cleared",
    )


def test_deletion_cleans_up_and_releases_the_finalizer(env: Env, leader: Operator) -> None:
    env.apply(
        pxc_body(
            "e2e-empty",
            mode="iptables",
            nodeSelector={"kpx.dev/pool": "nowhere"},
            deletionPolicy="Cleanup",
        )
    )
    wait_until(lambda: env.get("daemonset", "kpx-agent-e2e-empty", NS), 30, "agent DaemonSet")
    # No node matches: no agent Pod, no node to clean; done at once.
    env.kubectl("delete", "proxyconfiguration", "e2e-empty", "--timeout=60s")
    for kind, name, ns in (
        ("daemonset", "kpx-agent-e2e-empty", NS),
        ("daemonset", "kpx-cleanup-e2e-empty", NS),
        ("configmap", "kpx-agent-e2e-empty", NS),
    ):
        assert env.get(kind, name, ns) is None, (kind, name)
    reasons = env.reasons("e2e-empty")
    assert {("Normal", "CleanupStarted"), ("Normal", "CleanupDone")} <= reasons
    # The agents' identity and RBAC belong to the installation, not to a configuration.
    for kind, ns in (("serviceaccount", NS), ("clusterrole", None), ("clusterrolebinding", None)):
        assert env.get(kind, "kpx-agent", ns) is not None, kind


def test_deleting_with_the_default_policy_leaves_the_agents_running(
    env: Env, leader: Operator
) -> None:
    """Issue #22: spec.deletionPolicy Orphan (the default). Deleted as Argo CD prunes (foreground
    propagation), the agents' DaemonSet and ConfigMap stay: no garbage collector cascade, no
    cleanup; an Event says how to remove them later."""
    name = "e2e-orphan"
    env.apply(pxc_body(name, mode="nftables", nodeSelector={"kpx.dev/pool": "nowhere"}))
    wait_until(lambda: env.get("daemonset", f"kpx-agent-{name}", NS), 30, "agent DaemonSet")
    try:
        env.kubectl("delete", "proxyconfiguration", name, "--cascade=foreground", "--timeout=60s")
        assert env.get("proxyconfiguration", name) is None
        for kind in ("daemonset", "configmap"):
            obj = env.get(kind, f"kpx-agent-{name}", NS)
            assert obj is not None, kind
            assert not obj["metadata"].get("deletionTimestamp"), obj["metadata"]
        assert env.get("daemonset", f"kpx-cleanup-{name}", NS) is None
        orphaned = [e for e in env.events(name) if e["reason"] == "AgentsOrphaned"]
        assert orphaned and "proxy-agent cleanup --mode nftables" in orphaned[0]["message"]
        assert ("Normal", "CleanupStarted") not in env.reasons(name)
    finally:
        for kind in ("daemonset", "configmap"):
            env.kubectl(
                "-n", NS, "delete", kind, f"kpx-agent-{name}", "--ignore-not-found", check=False
            )


OPERATOR_SA = f"system:serviceaccount:{NS}:kpx-operator"
RBAC_KINDS = ("clusterroles", "clusterrolebindings", "roles", "rolebindings")


def can_i(env: Env, *args: str) -> bool:
    """`kubectl auth can-i ARGS` as the operator's ServiceAccount (impersonated by the admin)."""
    out = env.kubectl("auth", "can-i", *args, f"--as={OPERATOR_SA}", check=False)
    assert out.stdout.strip() in ("yes", "no"), (args, out.stdout, out.stderr)
    return out.stdout.strip() == "yes"


def can_i_list(env: Env, namespace: str) -> list[tuple[str, str, str]]:
    """(resource, resource names, verbs) of each line of `kubectl auth can-i --list`."""
    out = env.kubectl("auth", "can-i", "--list", "-n", namespace, f"--as={OPERATOR_SA}").stdout
    rows = []
    for line in out.splitlines()[1:]:  # header: Resources Non-Resource URLs Resource Names Verbs
        resource, _, rest = line.partition(" ")
        names = rest.split("[")[2].strip() if rest.count("[") >= 3 else ""
        rows.append((resource, names, rest.rsplit("[", 1)[-1].rstrip("]")))
    return rows


def test_operator_cannot_touch_any_role_or_binding(env: Env, leader: Operator) -> None:
    """The operator's ServiceAccount holds no RBAC permission: `kubectl auth can-i --list`
    shows none, and real attempts to delete or rewrite a role, or to bind cluster-admin, are
    refused by the apiserver (403) while its own work (DaemonSets) is allowed."""
    for namespace in (NS, "default"):
        rows = can_i_list(env, namespace)
        assert any(r[0] == "daemonsets.apps" for r in rows) is (namespace == NS), rows
        rbac = [r for r in rows if r[0].partition(".")[0] in RBAC_KINDS]
        assert rbac == [], rbac
        assert not [r for r in rows if r[0].partition(".")[0] in ("serviceaccounts", "secrets")]
    for verb in ("create", "update", "patch", "delete", "bind", "escalate"):
        for target in (
            "clusterroles",
            "clusterrole/cluster-admin",
            "clusterrole/kpx-agent",
            "clusterrolebindings",
            "clusterrolebinding/kpx-agent",
            "clusterrolebinding/kpx-operator",
        ):
            assert not can_i(env, verb, target), (verb, target)
        assert not can_i(env, verb, "roles", "-n", NS), verb
        assert not can_i(env, verb, "rolebindings", "-n", NS), verb
    assert can_i(env, "patch", "daemonsets.apps", "-n", NS)
    assert not can_i(env, "patch", "daemonsets.apps", "-n", "default")

    victim = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "e2e-rbac-victim"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    env.apply(victim)
    as_operator = {"kubeconfig": env.kubeconfig, "check": False}
    try:
        attempts = {
            "delete a role": ("delete", "clusterrole", "e2e-rbac-victim"),
            "rewrite a role": (
                "patch",
                "clusterrole",
                "e2e-rbac-victim",
                "--type=json",
                "-p",
                '[{"op":"add","path":"/rules/0/verbs/-","value":"delete"}]',
            ),
            "rewrite the agents' role": (
                "patch",
                "clusterrole",
                "kpx-agent",
                "--type=json",
                "-p",
                '[{"op":"add","path":"/rules/0/verbs/-","value":"delete"}]',
            ),
            "delete the agents' binding": ("delete", "clusterrolebinding", "kpx-agent"),
            "bind cluster-admin": (
                "create",
                "clusterrolebinding",
                "e2e-evil",
                "--clusterrole=cluster-admin",
                f"--serviceaccount={NS}:kpx-operator",
            ),
            "bind the agents' role": (
                "create",
                "clusterrolebinding",
                "e2e-evil-agent",
                "--clusterrole=kpx-agent",
                f"--serviceaccount={NS}:kpx-operator",
            ),
        }
        for what, args in attempts.items():
            out = env.cluster.kubectl(*args, "-v=6", **as_operator)  # -v=6: HTTP statuses
            assert out.returncode != 0, what
            assert "403 Forbidden" in out.stderr, (what, out.stderr)
            assert f'User "{OPERATOR_SA}" cannot' in out.stderr, (what, out.stderr)
        after = env.get("clusterrole", "e2e-rbac-victim") or {}
        assert after["rules"] == victim["rules"]
        assert (env.get("clusterrole", "kpx-agent") or {})["rules"] == list(AGENT_RULES)
        assert env.get("clusterrolebinding", "kpx-agent") is not None
        assert env.get("clusterrolebinding", "e2e-evil") is None
    finally:
        env.kubectl("delete", "clusterrole", "e2e-rbac-victim", "--ignore-not-found")
        env.kubectl(
            "delete", "clusterrolebinding", "e2e-evil", "e2e-evil-agent", "--ignore-not-found"
        )


def test_second_replica_takes_over(env: Env, leader: Operator) -> None:
    standby = env.start_operator("--ipvs-policy=warn")
    time.sleep(3)
    assert leader.is_leader() and not standby.is_leader()
    before = (env.get("lease", "kpx-operator", NS) or {})["spec"]
    leader.stop()  # a clean exit releases the Lease
    wait_until(standby.is_leader, 20, "standby leads")
    after = (env.get("lease", "kpx-operator", NS) or {})["spec"]
    assert after["holderIdentity"] != before["holderIdentity"]
    assert after["leaseTransitions"] == before["leaseTransitions"] + 1
    # The new leader repairs drift...
    env.kubectl("-n", NS, "delete", "daemonset", "kpx-agent-default", "--wait=false")
    wait_until(lambda: env.get("daemonset", "kpx-agent-default", NS), 30, "DaemonSet back")
    # The ipvs configuration is deployed under --ipvs-policy=warn (next test).


def test_ipvs_deploys_its_agents_when_the_policy_allows_it(env: Env) -> None:
    """mode ipvs (deprecated upstream, its backend is in the agent) under a policy that allows
    it (the standby of the previous test leads with --ipvs-policy=warn): the agents' DaemonSet
    and ConfigMap are deployed, Deprecated=True/IPVSDeprecated, never ModeNotImplemented. (The
    refusal of a mode without a backend is unit-tested with a narrowed gate: every mode has a
    backend now.)"""
    assert "ipvs" in MODES_WITH_BACKEND
    if not any(op.proc.poll() is None and op.is_leader() for op in env.operators):
        wait_until(env.start_operator("--ipvs-policy=allow").is_leader, 30, "operator leads")
    env.apply(example("proxyconfig-ipvs.yaml"))
    wait_until(lambda: env.get("daemonset", "kpx-agent-ipvs-pool", NS), 30, "ipvs DaemonSet")
    config = env.get("configmap", "kpx-agent-ipvs-pool", NS) or {}
    assert "mode: ipvs" in config["data"]["config.yaml"]
    deprecated = wait_until(lambda: env.condition("ipvs-pool", "Deprecated"), 30, "Deprecated")
    assert (deprecated["status"], deprecated["reason"]) == ("True", "IPVSDeprecated")
    degraded = env.condition("ipvs-pool", "Degraded") or {}
    assert degraded.get("reason") != "ModeNotImplemented"
    assert "ModeNotImplemented" not in {reason for _, reason in env.reasons("ipvs-pool")}


def test_killed_in_the_middle_of_a_reconcile_converges(env: Env) -> None:
    """SIGKILL the leader right after a new configuration arrives: no clean Lease release,
    children maybe half-applied. A fresh replica takes over once the Lease expires and
    finishes the job (everything is idempotent server-side apply)."""
    leaders = [op for op in env.operators if op.proc.poll() is None and op.is_leader()]
    leader = leaders[0] if leaders else env.start_operator("--ipvs-policy=warn")
    wait_until(leader.is_leader, 30, "a leader")
    env.apply(pxc_body("e2e-killed", mode="nftables", nodeSelector={"kpx.dev/pool": "none"}))
    time.sleep(0.3)  # the reconcile is under way
    leader.proc.kill()
    leader.proc.wait()
    for op in env.operators:
        op.stop()  # no standby: the new replica must wait out the Lease of the dead one
    fresh = env.start_operator("--ipvs-policy=warn")
    wait_until(fresh.is_leader, 40, "the new replica leads after the Lease expired")
    for kind, name, ns in (
        ("configmap", "kpx-agent-e2e-killed", NS),
        ("daemonset", "kpx-agent-e2e-killed", NS),
    ):
        wait_until(lambda k=kind, n=name, s=ns: env.get(k, n, s), 30, f"{kind} {name}")

    def current() -> Obj | None:
        pxc = env.get("proxyconfiguration", "e2e-killed") or {}
        st = pxc.get("status") or {}
        gen = (pxc.get("metadata") or {}).get("generation")
        return st if gen is not None and st.get("observedGeneration") == gen else None

    wait_until(current, 30, "status of the current generation")
    env.kubectl(
        "patch",
        "proxyconfiguration",
        "e2e-killed",
        "--type=merge",
        "-p",
        '{"spec":{"deletionPolicy":"Cleanup"}}',
    )
    env.kubectl("delete", "proxyconfiguration", "e2e-killed", "--timeout=60s")


def test_a_frozen_leader_does_not_write_when_it_wakes_up(env: Env) -> None:
    """SIGSTOP the leader (a paused VM, a stalled node): the standby takes over once the Lease
    expires. The frozen one denies ipvs, the new one allows it; the frozen one had a resync
    timer (every 2 s) running on an ipvs configuration, which on waking up would deny it again
    (delete its DaemonSet, write IPVSDenied). It must write nothing: it wakes up long past its
    write deadline, steps down and exits to restart as a candidate."""
    for op in env.operators:
        op.stop()
    frozen = env.start_operator("--ipvs-policy=deny")
    wait_until(frozen.is_leader, 40, "the deny replica leads")
    env.apply(
        pxc_body(
            "e2e-fenced",
            mode="ipvs",
            nodeSelector={"kpx.dev/pool": "none"},
            ipvs={"acknowledgeDeprecation": True},
        )
    )

    def reason() -> str:
        return str((env.condition("e2e-fenced", "Degraded") or {}).get("reason", ""))

    wait_until(lambda: reason() == "IPVSDenied", 30, "the frozen-to-be leader denies ipvs")
    standby = env.start_operator("--ipvs-policy=allow")
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(standby.is_leader, 40, "the standby leads after the Lease expired")
        ds = wait_until(lambda: env.get("daemonset", "kpx-agent-e2e-fenced", NS), 30, "DaemonSet")
        wait_until(lambda: reason() not in ("", "IPVSDenied"), 30, "the new leader's status")
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    assert frozen.proc.wait(30) != 0, "the woken leader went on instead of stepping down"
    for _ in range(12):  # 3 s: several of the new leader's resyncs
        time.sleep(0.25)
        after = env.get("daemonset", "kpx-agent-e2e-fenced", NS)
        assert after is not None, "the woken leader deleted the new leader's DaemonSet"
        assert after["metadata"]["uid"] == ds["metadata"]["uid"]
        assert reason() != "IPVSDenied", "the woken leader wrote its own status"
    assert standby.is_leader(), "the new leader lost the Lease to the woken one"
    env.kubectl("delete", "proxyconfiguration", "e2e-fenced", "--timeout=60s")


def kpx_tables(topology: Any, node: Any) -> set[str]:
    out = topology.exec(node, ["nft", "list", "tables"], check=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip().endswith(" kpx")}


@pytest.mark.netns
def test_agents_run_on_simulated_nodes_and_deletion_cleans_them(env: Env) -> None:
    """Real agents (node simulator: the agents' and the cleanup pods run from the agent image
    under runc in the node's netns), then the deletion flow: agents stopped, a cleanup pod per
    node removes the rules, the finalizer goes."""
    from kpx_cluster.netns import Topology
    from kpx_cluster.nodesim import NodeSimulator
    from kpx_cluster.nodesim.runc import built_images

    try:
        store = built_images()
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)
    if not any(op.proc.poll() is None and op.is_leader() for op in env.operators):
        wait_until(env.start_operator().is_leader, 30, "operator leads")  # test run alone
    env.apply(example("proxyconfig.yaml"))
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-sim": run}
    with Topology() as topo:
        sim = NodeSimulator(env.cluster, topo, runtime="runc", images=store)
        try:
            nodes = [sim.add_node(f"opsim-{run}-{i}", labels=label) for i in (1, 2)]
            # Move "default" onto the simulated nodes only (a new pod template: a rollout), with
            # the agent image the operator decides: an earlier test overrode spec.image with a
            # tag nothing built, which the simulator (as a kubelet) cannot pull.
            patch = {"spec": {"nodeSelector": label, "image": None, "deletionPolicy": "Cleanup"}}
            env.kubectl(
                "patch", "proxyconfiguration", "default", "--type=merge", "-p", json.dumps(patch)
            )

            def ready() -> Obj | None:
                pxc = env.get("proxyconfiguration", "default") or {}
                st = pxc.get("status") or {}
                cond = env.condition("default", "Ready") or {}
                current = st.get("observedGeneration") == pxc["metadata"]["generation"]
                done = cond.get("status") == "True" and st.get("readyNodes") == 2
                return st if done and current else None

            status = wait_until(ready, 90, "both agents ready")
            assert status["desiredNodes"] == 2
            progressing = env.condition("default", "Progressing") or {}
            assert (progressing["status"], progressing["reason"]) == ("False", "RolloutComplete")
            for node in nodes:  # Ready means synced: the rules are in place
                assert kpx_tables(topo, node), f"no kpx table on {node.name}"
            names = {n.name for n in nodes}
            pods = json.loads(
                env.kubectl(
                    "-n", NS, "get", "pods", "-o", "json", "-l", "app.kubernetes.io/name=kpx-agent"
                ).stdout
            )
            ours = [p for p in pods["items"] if p["spec"].get("nodeName") in names]
            assert len(ours) == 2
            for pod in ours:  # from the image, under runc (not a host process)
                (status,) = pod["status"]["containerStatuses"]
                assert status["containerID"].startswith("runc://"), status

            # spec.conntrack asks for a table larger than the host's: nf_conntrack_max is global
            # to the host and read-only in a node's network namespace, so each agent records
            # ConntrackNotApplied on its own Pod (ServiceAccount kpx-agent, create events only)
            # and the operator turns that into Degraded, naming the nodes.
            host_max = int(Path("/proc/sys/net/netfilter/nf_conntrack_max").read_text())
            conntrack = {"maxPerCore": 1, "min": host_max * 2}
            env.kubectl(
                "patch",
                "proxyconfiguration",
                "default",
                "--type=merge",
                "-p",
                json.dumps({"spec": {"conntrack": conntrack}}),
            )

            def conntrack_reported() -> Obj | None:
                cond = env.condition("default", "Degraded") or {}
                named = all(n.name in cond.get("message", "") for n in nodes)
                return cond if cond.get("reason") == "ConntrackNotApplied" and named else None

            degraded = wait_until(conntrack_reported, 60, "Degraded/ConntrackNotApplied")
            assert degraded["status"] == "True"
            assert "not in the host's network namespace" in degraded["message"]
            assert f"nf_conntrack_max: wants {host_max * 2} (now {host_max})" in degraded["message"]
            assert int(Path("/proc/sys/net/netfilter/nf_conntrack_max").read_text()) == host_max
            wait_until(
                lambda: (env.condition("default", "Ready") or {}).get("status") == "True",
                90,
                "Ready again after the conntrack change's rollout",
            )
            out = env.kubectl(
                "-n",
                NS,
                "get",
                "events",
                "-o",
                "json",
                "--field-selector=reason=ConntrackNotApplied",
            ).stdout
            reported = json.loads(out)["items"]
            assert {e["involvedObject"]["kind"] for e in reported} == {"Pod"}
            assert {e["source"]["host"] for e in reported} >= {n.name for n in nodes}

            # Deletion (Cleanup): node by node, the agent stops and the cleanup DaemonSet's Pod
            # cleans the node; then the finalizer goes.
            env.kubectl("delete", "proxyconfiguration", "default", "--timeout=120s")
            for node in nodes:
                assert kpx_tables(topo, node) == set(), node.name
            reasons = env.reasons("default")
            assert {("Normal", "CleanupStarted"), ("Normal", "CleanupDone")} <= reasons
            assert env.get("daemonset", "kpx-cleanup-default", NS) is None
            assert sim.refused == []
        finally:
            sim.stop(delete_nodes=True)
