"""kube_proxy_leftovers.py: from upstream kube-proxy's iptables-save output (with the kubelet's
chains, a CNI's chain and kpx's own among them) to the script that removes kube-proxy's rules
and nothing else; and which Pods count as kube-proxy still running on a node."""

from __future__ import annotations

from pathlib import Path

from kpx_agent.handover.from_kube_proxy import kube_proxy_pods
from kpx_agent.handover.kube_proxy_leftovers import (
    IPSETS,
    describe,
    ipsets_to_destroy,
    nft_script,
    plan_table,
)

SAVE = (Path(__file__).parent / "golden" / "kube_proxy" / "iptables-save-v4.txt").read_text()


def test_nat_removes_kube_proxy_chains_and_jumps_and_keeps_everyone_elses() -> None:
    plan = plan_table("nat", SAVE)
    assert plan.jumps == [
        '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-D OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-D POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
    ]
    # KUBE-MARK-MASQ is kube-proxy's, but the CNI's hostport chain still jumps to it: kept.
    assert plan.kept == ["KUBE-MARK-MASQ"]
    assert plan.chains == [
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-PROXY-CANARY",
        "KUBE-SEP-6E7XQMQ4RAYOWTTM",
        "KUBE-SEP-IT2ZTR26TO4XFPTO",
        "KUBE-SERVICES",
        "KUBE-SVC-ERIFXISQEP7F7OF4",
        "KUBE-SVC-NPX46M4PTMTKRN6Y",
        "KUBE-EXT-ERIFXISQEP7F7OF4",
    ]
    script = plan.script()
    for survivor in ("CNI-HOSTPORT-DNAT", "KPX-SERVICES", "KUBE-KUBELET-CANARY"):
        assert survivor not in script
    lines = script.splitlines()
    assert lines[0] == "*nat" and lines[-1] == "COMMIT"
    # Jumps first, then every chain flushed before any is deleted (they reference each other).
    first_flush = next(i for i, line in enumerate(lines) if line.startswith("-F "))
    last_jump = max(i for i, line in enumerate(lines) if line.startswith("-D "))
    last_flush = max(i for i, line in enumerate(lines) if line.startswith("-F "))
    first_delete = next(i for i, line in enumerate(lines) if line.startswith("-X "))
    assert last_jump < first_flush and last_flush < first_delete


def test_filter_keeps_the_kubelets_firewall_and_site_rules() -> None:
    plan = plan_table("filter", SAVE)
    assert all("KUBE-FIREWALL" not in jump and "SITE-FILTER" not in jump for jump in plan.jumps)
    assert len(plan.jumps) == 9
    assert plan.chains == [
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-CANARY",
        "KUBE-PROXY-FIREWALL",
        "KUBE-SERVICES",
    ]
    assert "KUBE-FIREWALL" not in plan.script() and plan.kept == []


def test_mangle_only_the_canary() -> None:
    plan = plan_table("mangle", SAVE)
    assert plan.jumps == [] and plan.chains == ["KUBE-PROXY-CANARY"]
    assert "KUBE-IPTABLES-HINT" not in plan.script()


def test_nothing_of_kube_proxy_gives_an_empty_script() -> None:
    foreign = (
        "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KPX-SERVICES - [0:0]\n"
    )
    foreign += "-A PREROUTING -m comment --comment kpx -j KPX-SERVICES\nCOMMIT\n"
    assert plan_table("nat", foreign).script() == ""
    assert plan_table("nat", "").script() == ""
    assert describe([plan_table("nat", foreign)]) == "nothing"


def test_a_chain_reached_only_through_a_kept_chain_is_kept_too() -> None:
    text = "\n".join(
        [
            "*nat",
            ":PREROUTING ACCEPT [0:0]",
            ":MINE - [0:0]",
            ":KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]",
            ":KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]",
            "-A MINE -j KUBE-SVC-AAAAAAAAAAAAAAAA",
            "-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB",
            "COMMIT",
            "",
        ]
    )
    plan = plan_table("nat", text)
    assert plan.chains == [] and plan.kept == [
        "KUBE-SEP-BBBBBBBBBBBBBBBB",
        "KUBE-SVC-AAAAAAAAAAAAAAAA",
    ]
    assert "kept" in describe([plan])


def test_nft_script_deletes_the_tables_named() -> None:
    tables = ["ip kube-proxy", "ip6 kube-proxy"]
    assert nft_script(tables) == "delete table ip kube-proxy\ndelete table ip6 kube-proxy\n"


def _pod(name: str, owner: str, kind: str = "DaemonSet", phase: str = "Running") -> dict:
    return {
        "metadata": {"name": name, "ownerReferences": [{"kind": kind, "name": owner}]},
        "status": {"phase": phase},
    }


def test_kube_proxy_pods_are_those_of_its_daemonset_not_finished() -> None:
    pods = [
        _pod("kube-proxy-abcde", "kube-proxy"),
        _pod("coredns-1", "coredns-5d78c9869d", kind="ReplicaSet"),
        _pod("kube-proxy-lookalike", "kube-proxy-extra"),
        _pod("kube-proxy-old", "kube-proxy", phase="Failed"),
    ]
    assert kube_proxy_pods(pods) == ["kube-proxy-abcde"]
    terminating = _pod("kube-proxy-x", "kube-proxy")
    terminating["metadata"]["deletionTimestamp"] = "2026-11-24T12:00:00Z"
    assert kube_proxy_pods([terminating]) == ["kube-proxy-x"]  # still programming, maybe
    assert kube_proxy_pods([]) == []


def test_kube_proxys_ipsets_are_its_exact_names_in_both_families() -> None:
    names = [
        "KUBE-CLUSTER-IP",
        "KUBE-6-CLUSTER-IP",
        "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
        "KUBE-6-IPVS-IPS",
        "KUBE-CLUSTER-IP-EXTRA",
        "KUBE-SITE",
        "cni-hostport",
        "kpx",
    ]
    assert ipsets_to_destroy(names) == [
        "KUBE-6-CLUSTER-IP",
        "KUBE-6-IPVS-IPS",
        "KUBE-CLUSTER-IP",
        "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    ]
    assert ipsets_to_destroy([]) == []
    # as upstream v1.36 names them (pkg/proxy/ipvs/ipset.go), IPv4 and IPv6
    assert {
        "KUBE-LOOP-BACK",
        "KUBE-6-LOOP-BACK",
        "KUBE-HEALTH-CHECK-NODE-PORT",
        "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        "KUBE-6-NODE-PORT-UDP",
    } <= IPSETS
