"""Issue #18, taking nodes over from upstream kube-proxy with spec.takeover.moveKubeProxyOff:
the operator (its shipped RBAC, as a subprocess) against the real apiserver and
controller-manager, real agents on two simulated nodes (the node simulator runs the pods of
every DaemonSet as processes in the nodes' network namespaces).

kube-system/kube-proxy is a stand-in DaemonSet (its container sleeps: the node simulator runs
no kube-proxy binary) whose "rules" are an `ip kube-proxy` nftables table put on each node by
the test. Node by node: the agent's first verified sync (Event FirstSyncVerified) -> the
operator labels the node and has patched kube-proxy's affinity -> the DaemonSet controller
takes kube-proxy's Pod off the node -> the agent sees it gone and removes kube-proxy's table
(KubeProxyRulesRemoved) -> status.takeover says so. Deleting the ProxyConfiguration
(deletionPolicy Cleanup) removes the labels node by node, so the DaemonSet controller puts
kube-proxy back on both nodes, and then removes kpx's rules there.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from test_operator import NS, Env, env, kpx_tables, pxc_body, wait_until

from kpx_api.takeover import KUBE_PROXY_OFF_LABEL

pytestmark = [pytest.mark.e2e, pytest.mark.netns]
__all__ = ["env"]  # the module-scoped fixture of test_operator.py
PXC = "e2e-takeover"
Obj = dict[str, Any]


def kube_proxy_daemonset() -> Obj:
    labels = {"k8s-app": "kube-proxy"}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system", "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "hostNetwork": True,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "kube-proxy",
                            "image": "registry.k8s.io/kube-proxy:v1.36.0",
                            "command": ["sleep", "3600"],
                        }
                    ],
                },
            },
        },
    }


def kube_proxy_nodes(env: Env) -> set[str]:
    out = env.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-proxy", "-o", "json"
    ).stdout
    return {
        p["spec"].get("nodeName", "")
        for p in json.loads(out)["items"]
        if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"
    }


def test_kube_proxy_moves_off_node_by_node_and_comes_back_on_deletion(env: Env) -> None:
    from kpx_cluster.netns import Topology
    from kpx_cluster.nodesim import NodeSimulator

    if not any(op.proc.poll() is None and op.is_leader() for op in env.operators):
        wait_until(env.start_operator().is_leader, 30, "operator leads")
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-takeover": run}
    with Topology() as topo:
        sim = NodeSimulator(env.cluster, topo)
        try:
            nodes = [sim.add_node(f"tk-{run}-{i}", labels=label) for i in (1, 2)]
            names = {n.name for n in nodes}
            # Upstream kube-proxy runs on both nodes, with its rules there.
            env.apply(kube_proxy_daemonset())
            wait_until(lambda: names <= kube_proxy_nodes(env), 90, "kube-proxy on both nodes")
            for node in nodes:
                topo.exec(node, ["nft", "add", "table", "ip", "kube-proxy"], check=True)

            takeover_spec = {"fromKubeProxy": True, "moveKubeProxyOff": True}
            env.apply(
                pxc_body(
                    PXC,
                    mode="nftables",
                    nodeSelector=label,
                    takeover=takeover_spec,
                    deletionPolicy="Cleanup",
                )
            )

            def taken_over() -> Obj | None:
                st = (env.get("proxyconfiguration", PXC) or {}).get("status") or {}
                t = st.get("takeover") or {}
                phases = {n["name"]: n["phase"] for n in t.get("nodes") or []}
                done = phases == dict.fromkeys(names, "KubeProxyRulesRemoved")
                return t if done else None

            takeover = wait_until(taken_over, 180, "both nodes taken over")
            assert takeover["done"] == 2, takeover
            assert takeover["summary"].startswith("2 of 2 nodes taken over"), takeover
            assert all(n["kubeProxyOff"] for n in takeover["nodes"]), takeover
            # Each node carries the label, kube-proxy's DaemonSet excludes it, its Pods are gone
            # from both nodes, its rules too; kpx's are in.
            for name in names:
                node_labels = (env.get("node", name) or {})["metadata"]["labels"]
                assert node_labels.get(KUBE_PROXY_OFF_LABEL) == "true", node_labels
            ds = env.get("daemonset", "kube-proxy", "kube-system") or {}
            terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
            assert terms == [
                {"matchExpressions": [{"key": KUBE_PROXY_OFF_LABEL, "operator": "DoesNotExist"}]}
            ]
            assert not names & kube_proxy_nodes(env)
            for node in nodes:
                tables = topo.exec(node, ["nft", "list", "tables"], check=True).stdout
                assert "kube-proxy" not in tables and kpx_tables(topo, node), tables
            reasons = env.reasons(PXC)
            for reason in (
                "KubeProxyAffinityPatched",
                "KubeProxyMovedOff",
                "KubeProxyRulesRemoved",
            ):
                assert ("Normal", reason) in reasons, (reason, reasons)
            # The agent serves (AgentReady), and finds kube-proxy's Pod still there
            # (WaitingForKubeProxy: it reports that at once, so a pass may not see AgentReady).
            assert {("Normal", "AgentReady"), ("Normal", "WaitingForKubeProxy")} & reasons
            moved = [e for e in env.events(PXC) if e["reason"] == "KubeProxyMovedOff"]
            assert {n for n in names if any(n in e["message"] for e in moved)} == names

            # Preflight: each agent reported which modes its node can run; nftables runs here.
            preflight = wait_until(lambda: env.condition(PXC, "Preflight"), 60, "Preflight")
            assert (preflight["status"], preflight["reason"]) == ("True", "ModeCanRun"), preflight
            assert "(2)" in preflight["message"], preflight

            # Deletion (deletionPolicy Cleanup): node by node, the label goes, kube-proxy comes
            # back and turns Ready, and only then the node's agent stops and its rules go.
            env.kubectl("delete", "proxyconfiguration", PXC, "--timeout=180s")
            for name in names:
                node_labels = (env.get("node", name) or {})["metadata"].get("labels") or {}
                assert KUBE_PROXY_OFF_LABEL not in node_labels, node_labels
                assert not {k for k in node_labels if k.startswith("proxy.kpx.dev/")}
            wait_until(lambda: names <= kube_proxy_nodes(env), 90, "kube-proxy back on both")
            for node in nodes:
                assert kpx_tables(topo, node) == set(), node.name
            said = [e["reason"] for e in env.events(PXC)]
            assert said.count("KubeProxyMovedBack") == 2, said  # one per node
            assert "CleanupDone" in said, said
            assert sim.refused == []
        finally:
            env.kubectl(
                "patch",
                "proxyconfiguration",
                PXC,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
            env.kubectl(
                "delete",
                "proxyconfiguration",
                PXC,
                "--ignore-not-found",
                "--wait=false",
                check=False,
            )
            env.kubectl(
                "-n",
                "kube-system",
                "delete",
                "daemonset",
                "kube-proxy",
                "--ignore-not-found",
                check=False,
            )
            sim.stop(delete_nodes=True)


def test_a_mode_switch_that_drops_a_setting_waits_for_its_acceptance(env: Env) -> None:
    """No agent runs (no node matches): the operator alone, against the real apiserver (the
    CRD validates spec.modeSwitch). iptables answers NodePorts on 127.0.0.1 by default;
    nftables has none by default: the switch waits for spec.modeSwitch.acceptDropped, or
    for nftables.localhostNodePorts: true, which carries them over."""
    if not any(op.proc.poll() is None and op.is_leader() for op in env.operators):
        wait_until(env.start_operator().is_leader, 30, "operator leads")
    name = "e2e-held-switch"
    selector = {"kpx.dev/e2e-none": "none"}
    config = f"kpx-agent-{name}"

    def mode_in_effect() -> str:
        cm = env.get("configmap", config, NS) or {}
        text = (cm.get("data") or {}).get("config.yaml", "")
        return next(
            (line.split(": ")[1] for line in text.splitlines() if line.startswith("mode: ")), ""
        )

    try:
        env.apply(pxc_body(name, mode="iptables", nodeSelector=selector))
        wait_until(lambda: mode_in_effect() == "iptables", 30, "iptables agents' config")
        env.apply(pxc_body(name, mode="nftables", nodeSelector=selector))

        def held() -> Obj | None:
            cond = env.condition(name, "Preflight") or {}
            return cond if cond.get("reason") == "SettingsNotCarriedOver" else None

        cond = wait_until(held, 30, "Preflight/SettingsNotCarriedOver")
        assert cond["status"] == "False"
        assert "spec.modeSwitch.acceptDropped: [localhostNodePorts]" in cond["message"], cond
        assert mode_in_effect() == "iptables"
        assert ("Warning", "ModeSwitchHeld") in env.reasons(name)
        bad = env.kubectl(
            "apply",
            "--server-side",
            "--field-manager=kpx-e2e",
            "-f",
            "-",
            input=json.dumps(
                pxc_body(
                    name,
                    mode="nftables",
                    nodeSelector=selector,
                    modeSwitch={"acceptDropped": ["nope"]},
                )
            ),
            check=False,
        )
        assert bad.returncode != 0 and "acceptDropped" in bad.stderr, bad.stderr
        env.apply(
            pxc_body(
                name,
                mode="nftables",
                nodeSelector=selector,
                modeSwitch={"acceptDropped": ["localhostNodePorts"]},
            )
        )
        wait_until(lambda: mode_in_effect() == "nftables", 30, "the switch proceeds")
        # Back to iptables (nothing lost), then to nftables with its opt-in
        # nftables.localhostNodePorts: carried over, nothing to accept.
        env.apply(pxc_body(name, mode="iptables", nodeSelector=selector))
        wait_until(lambda: mode_in_effect() == "iptables", 30, "back to iptables")
        env.apply(
            pxc_body(
                name, mode="nftables", nodeSelector=selector, nftables={"localhostNodePorts": True}
            )
        )
        wait_until(lambda: mode_in_effect() == "nftables", 30, "carried over, not held")
        cm = env.get("configmap", config, NS) or {}
        assert "localhostNodePorts: true" in (cm.get("data") or {}).get("config.yaml", ""), cm
        ds = env.get("daemonset", config, NS) or {}
        (agent,) = [
            c
            for c in ds["spec"]["template"]["spec"]["containers"]
            if "--route-localnet-file" in c["command"]
        ]
        assert agent["command"][1:3] == ["--mode", "nftables"], agent["command"]
    finally:
        env.kubectl(
            "delete", "proxyconfiguration", name, "--ignore-not-found", "--timeout=60s", check=False
        )
