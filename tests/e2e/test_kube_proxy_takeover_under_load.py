"""Issue #18, proof under load: upstream kube-proxy -> kpx nftables on three real nodes (a kubelet
and containerd each).

Upstream kube-proxy v1.36.2 (its image, which `make image` builds from the binary `make setup`
compiles from the pinned Kubernetes module) serves the three nodes in iptables mode, as the
kube-system/kube-proxy DaemonSet kubeadm deploys (`kpx_cluster.upstream_kube_proxy`); backend
pods on every node serve two ClusterIP Services and a NodePort, and a load client in a pod
netns on every node opens a new TCP connection every 15 ms, exchanges a UDP datagram every
20 ms and holds two connections open (`kpx_cluster.migration_real`). Then kpx is installed from
its manifests (the operator and the agents from the project's images) with a
ProxyConfiguration in mode nftables and `takeover: {fromKubeProxy: true, moveKubeProxyOff:
true}`: on each node the agent programs and verifies nftables (while kube-proxy still holds
the health and metrics ports: the agent retries binding them, as upstream does), the operator
labels the node and keeps kube-proxy's DaemonSet off it, the agent removes kube-proxy's rules
once its Pod is gone (`kpx_cluster.migration_takeover`). Not one new connection may fail, not
one UDP exchange be lost, every held connection must survive; afterwards no node runs
kube-proxy, no node has one of kube-proxy's chains (the kubelet's KUBE-FIREWALL and co. may
stay) or an `ip kube-proxy` table, and status.takeover says every node was taken over.
`make bench-migration` prints the same run as a row of its table.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kpx_cluster.kubelets import install
from kpx_cluster.migration import LoadOptions, MigrationEnv, mode_rules, preflight_load, table_row
from kpx_cluster.migration_real import real_kube_proxy_cluster
from kpx_cluster.migration_takeover import (
    kube_proxy_pods,
    kube_proxy_rules,
    take_over,
    takeover_phases,
)

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


@pytest.fixture(scope="module")
def env() -> Iterator[MigrationEnv]:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    try:
        install.archives("kpx")  # the images are built and fresh
        install.archives("kube-proxy")
    except install.InstallFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    with real_kube_proxy_cluster("iptables") as env:
        yield env


def test_taking_over_from_upstream_kube_proxy_under_load_fails_nothing_and_leaves_nothing(
    env: MigrationEnv,
) -> None:
    # Before: upstream kube-proxy serves every target from every node, with its iptables rules.
    for summary in preflight_load(env):
        assert summary.tcp.failed == 0 and summary.udp.failed == 0, summary
        assert summary.held_survived == len(summary.held) == 1, summary.held
        assert len(summary.tcp.backends) == len(env.nodes), summary.tcp.backends
    assert set(kube_proxy_pods(env)) == {n.name for n in env.nodes}
    for node in env.nodes:
        found = kube_proxy_rules(env.topo, node)
        assert any(":KUBE-SERVICES" in line for line in found), f"{node.name}: {found}"
        assert mode_rules(env.topo, node, "nftables") == []  # no kpx yet

    result = take_over(env, "iptables", LoadOptions())
    print(table_row(result))

    assert result.failures() == [], "\n".join(result.failures())
    # Enough load to tell: the whole takeover was covered at the fixed rate.
    assert result.load_seconds > result.duration
    assert result.total("tcp", "tried") > 0.8 * result.load_seconds / 0.015 * len(env.nodes)
    assert result.total("udp", "tried") > 0.8 * result.load_seconds / 0.02 * len(env.nodes)
    assert result.held == 2 * len(env.nodes)
    # After: kpx serves every node, kube-proxy runs on none and left nothing there.
    assert kube_proxy_pods(env) == {}
    assert takeover_phases(env) == dict.fromkeys(
        (n.name for n in env.nodes), "KubeProxyRulesRemoved"
    )
    for node in env.nodes:
        assert mode_rules(env.topo, node, "nftables"), f"{node.name}: no kpx nftables table"
        assert kube_proxy_rules(env.topo, node) == []
