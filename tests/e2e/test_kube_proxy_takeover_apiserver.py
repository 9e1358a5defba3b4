"""Issue #18, taking over from kube-proxy: how an agent knows kube-proxy has left its node,
against the real apiserver, with the agents' RBAC as shipped (operator/manifests/agent-rbac.yaml,
Role kpx-agent-takeover in kube-system: list Pods there, nothing else).

A kube-system/kube-proxy DaemonSet that schedules nothing itself (a nodeSelector no node has),
and a Pod of it (an ownerReference to it) bound to one Node: the agent of that node sees
kube-proxy running until the Pod is deleted; the agent of another node never does. The agent's
identity may list Pods in kube-system only, and read nothing else of them.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from agent_harness import wait_until

from kpx_agent.handover.from_kube_proxy import kube_proxy_runs_here
from kpx_cluster.controlplane import Cluster
from kpx_kube import Client, Forbidden, from_kubeconfig

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
AGENT_USER = "system:serviceaccount:kpx-system:kpx-agent"


def takeover_rbac() -> list[dict]:
    docs = yaml.safe_load_all((REPO / "operator/manifests/agent-rbac.yaml").read_text())
    return [d for d in docs if d and d["metadata"]["name"] == "kpx-agent-takeover"]


@pytest.fixture
def setup(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[Cluster, Path, str]]:
    node = f"tk-{secrets.token_hex(3)}"
    objs = takeover_rbac()
    assert [o["kind"] for o in objs] == ["Role", "RoleBinding"]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    )
    ds = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
        "spec": {
            "selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
            "template": {
                "metadata": {"labels": {"k8s-app": "kube-proxy"}},
                "spec": {
                    "nodeSelector": {"kpx.test/no-node": "x"},
                    "containers": [{"name": "kube-proxy", "image": "kube-proxy:test"}],
                },
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ds))
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(  # the Pod's admission needs it
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": "kube-system"},
            }
        ),
    )
    for name in (node, f"{node}-other"):
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}),
        )
    kubeconfig = cluster.client_kubeconfig(
        AGENT_USER, ("system:serviceaccounts",), tmp_path / "agent.kubeconfig"
    )
    try:
        yield cluster, kubeconfig, node
    finally:
        cluster.kubectl(
            "-n",
            "kube-system",
            "delete",
            "pod",
            f"kube-proxy-{node}",
            "--force",
            "--ignore-not-found",
            "--grace-period=0",
            check=False,
        )
        for name in (node, f"{node}-other"):
            cluster.kubectl(
                "delete", "node", name, "--ignore-not-found", "--wait=false", check=False
            )
        for kind in (
            "daemonset/kube-proxy",
            "role/kpx-agent-takeover",
            "rolebinding/kpx-agent-takeover",
        ):
            cluster.kubectl(
                "-n",
                "kube-system",
                "delete",
                kind,
                "--ignore-not-found",
                "--wait=false",
                check=False,
            )


def runs_here(kubeconfig: Path, node: str) -> bool:
    async def ask() -> bool:
        client = Client(from_kubeconfig(kubeconfig))
        try:
            return await kube_proxy_runs_here(client, node)
        finally:
            await client.close()

    return asyncio.run(ask())


def test_agent_sees_kube_proxy_on_its_node_until_the_pod_is_gone(
    setup: tuple[Cluster, Path, str],
) -> None:
    cluster, kubeconfig, node = setup
    ds = json.loads(
        cluster.kubectl("-n", "kube-system", "get", "daemonset", "kube-proxy", "-o", "json").stdout
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"kube-proxy-{node}",
            "namespace": "kube-system",
            # Not the DaemonSet's controller: its controller leaves the Pod alone (no kubelet).
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": "kube-proxy",
                    "uid": ds["metadata"]["uid"],
                }
            ],
        },
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [{"name": "kube-proxy", "image": "kube-proxy:test"}],
        },
    }
    assert not runs_here(kubeconfig, node)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    assert runs_here(kubeconfig, node)
    assert not runs_here(kubeconfig, f"{node}-other")

    # Least privilege: list in kube-system only; no get, no other namespace.
    async def forbidden(path: str, params: dict[str, str] | None = None) -> bool:
        client = Client(from_kubeconfig(kubeconfig))
        try:
            if params is None:
                await client.get(path)
            else:
                await client.list("pods", path, params)
        except Forbidden:
            return True
        finally:
            await client.close()
        return False

    assert asyncio.run(forbidden("/api/v1/namespaces/default/pods", {}))
    assert asyncio.run(forbidden(f"/api/v1/namespaces/kube-system/pods/kube-proxy-{node}"))
    assert asyncio.run(forbidden("/api/v1/namespaces/kube-system/secrets", {}))

    cluster.kubectl(
        "-n", "kube-system", "delete", "pod", f"kube-proxy-{node}", "--grace-period=0", "--force"
    )
    wait_until(
        lambda: not runs_here(kubeconfig, node),
        30,
        0.5,
        message="kube-proxy still seen on the node after its Pod was deleted",
    )


def test_agent_removes_kube_proxys_rules_only_after_its_pod_left_the_node(
    setup: tuple[Cluster, Path, str],
) -> None:
    """The whole chain in one agent (nftables, spec.takeover.fromKubeProxy): upstream's rules
    stay while a kube-proxy Pod is on the agent's node, and go once it is deleted."""
    from agent_harness import build_agent_env, write_agent_config

    cluster = setup[0]
    rules = (REPO / "tests/e2e/kube_proxy_rules/upstream-v4.rules").read_text()
    with build_agent_env(cluster, "nftables", start=False) as env:
        env.topology.exec(
            env.n1,
            ["iptables-legacy-restore", "--noflush"],
            check=True,
            input=rules.format(vip="10.96.0.10", b1=env.pods["b1"].ipv4),
        )
        ds = json.loads(
            cluster.kubectl(
                "-n", "kube-system", "get", "daemonset", "kube-proxy", "-o", "json"
            ).stdout
        )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "kube-proxy-n1",
                "namespace": "kube-system",
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "DaemonSet",
                        "name": "kube-proxy",
                        "uid": ds["metadata"]["uid"],
                    }
                ],
            },
            "spec": {
                "nodeName": "n1",
                "automountServiceAccountToken": False,
                "containers": [{"name": "kube-proxy", "image": "kube-proxy:test"}],
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        try:
            config = write_agent_config(
                env.topology.tmpdir / "takeover.yaml",
                "nftables",
                extra={"takeover": {"fromKubeProxy": True}},
            )
            agent = env.start_agent("n1", config=config)

            def upstream() -> bool:
                save = env.topology.exec(env.n1, ["iptables-legacy-save"], check=True).stdout
                return "KUBE-SVC-ERIFXISQEP7F7OF4" in save

            wait_until(
                lambda: agent.metric("kpx_leftovers_pending", leftovers="iptables") == 0,
                15,
                0.2,
                message=agent.log_tail,
            )
            assert upstream(), "kube-proxy's rules went while its Pod was on the node"
            assert agent.metric("kpx_leftovers_pending", leftovers="kube-proxy") == 1
            assert "kube-system/kube-proxy runs on this node" in agent.log()
        finally:
            cluster.kubectl(
                "-n",
                "kube-system",
                "delete",
                "pod",
                "kube-proxy-n1",
                "--force",
                "--grace-period=0",
                "--ignore-not-found",
                check=False,
            )
        wait_until(
            lambda: not upstream(),
            30,
            0.5,
            message=lambda: f"kube-proxy's rules stay:\n{agent.log_tail()}",
        )
        # The gauge is set once the whole removal returned (its IPVS step comes after the
        # iptables rules are gone).
        wait_until(
            lambda: agent.metric("kpx_leftovers_pending", leftovers="kube-proxy") == 0,
            10,
            0.2,
            message=agent.log_tail,
        )
        save = env.topology.exec(env.n1, ["iptables-legacy-save"], check=True).stdout
        assert "KUBE-FIREWALL" in save and "CNI-HOSTPORT-DNAT" in save
