"""Issue #18, proof under load: spec.mode iptables -> nftables on three real nodes (a kubelet
and containerd each, no kube-proxy) while a client on every node keeps opening connections,
exchanging UDP and holding connections open.

kpx is installed from its manifests (the operator and the agents run from the project's images
on the kubelets) in mode iptables; backend pods on every node serve two ClusterIP Services and
a NodePort (`kpx_cluster.migration_real`). A load client in a pod netns on every node opens a
new TCP connection every 15 ms (round-robin over the three ClusterIPs and the NodePort on each
node's address), exchanges a UDP datagram every 20 ms the same way, and holds two connections open.
Then spec.mode is patched to nftables: the agents' DaemonSet rolls one node at a time; each new
agent programs nftables, verifies it, then removes the iptables rules. Not one new connection
may fail, not one UDP exchange be lost, every held connection must survive, and afterwards no
node may have a KPX- chain or a jump into one, in any iptables variant. `make bench-migration`
runs both directions and prints the table (bench/migration.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from kpx_cluster.kubelets import install
from kpx_cluster.migration import (
    LoadOptions,
    MigrationEnv,
    mode_rules,
    mode_switch_finished,
    preflight_load,
    switch,
    table_row,
)
from kpx_cluster.migration_real import real_migration_cluster
from kpx_cluster.migration_revert import revert_while_stuck
from kpx_cluster.migration_rollback import switch_with_rollback

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


@pytest.fixture(scope="module")
def env() -> Iterator[MigrationEnv]:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    try:
        install.archives("kpx")  # the images are built and fresh
    except install.InstallFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    with real_migration_cluster("iptables") as env:
        yield env


def test_iptables_to_nftables_under_load_fails_nothing_and_leaves_nothing(
    env: MigrationEnv,
) -> None:
    # The load itself works before the switch: every target answers, from every node.
    for summary in preflight_load(env):
        assert summary.tcp.failed == 0 and summary.udp.failed == 0, summary
        assert summary.held_survived == len(summary.held) == 1, summary.held
        assert len(summary.tcp.backends) == len(env.nodes), summary.tcp.backends
    for node in env.nodes:
        assert mode_rules(env.topo, node, "iptables"), f"{node.name}: no iptables rules"

    result = switch(env, "iptables", "nftables", LoadOptions())
    print(table_row(result))

    assert result.failures() == [], "\n".join(result.failures())
    # Enough load to tell: the whole rollout was covered at the fixed rate.
    assert result.load_seconds > result.duration
    assert result.total("tcp", "tried") > 0.8 * result.load_seconds / 0.015 * len(env.nodes)
    assert result.total("udp", "tried") > 0.8 * result.load_seconds / 0.02 * len(env.nodes)
    assert result.held == 2 * len(env.nodes)
    # Node by node (maxUnavailable 1): the new agents became Ready one after another.
    times = sorted(result.node_ready.values())
    assert len(times) == len(env.nodes)
    assert all(b - a > 0.5 for a, b in itertools.pairwise(times)), result.node_ready
    # The new mode serves on every node, the old one left nothing.
    for node in env.nodes:
        assert mode_rules(env.topo, node, "nftables"), f"{node.name}: no kpx nftables table"
        assert mode_rules(env.topo, node, "iptables") == []
    # status.modeSwitch ends with every node Switched and a summary.
    done = mode_switch_finished(env, 60)
    assert (done.get("fromMode"), done.get("toMode")) == ("iptables", "nftables"), done
    assert {n["name"]: n["phase"] for n in done.get("nodes", [])} == {
        n.name: "Switched" for n in env.nodes
    }, done
    assert done.get("switched") == len(env.nodes) and done.get("finishedAt"), done
    assert done["summary"].startswith("3 of 3 nodes switched from iptables to nftables in "), done


@pytest.mark.long  # 70-85 s each: `make test-long`, not `make test`
def test_a_node_whose_new_agent_cannot_program_is_rolled_back_stops_the_rollout_and_serves(
    env: MigrationEnv,
) -> None:
    """nftables refused on one node (another socket owns the table `ip kpx`) for longer than
    spec.modeSwitch.progressDeadlineSeconds (10 s): its new agent never has a verified sync, so
    it rolls the node back to iptables by itself - it programs the iptables rules (which it
    never removed) from then on, live - and stays not Ready, so the DaemonSet's rolling update
    stops there; status.modeSwitch shows the node RolledBack, with why and what to do. A
    Service created after the rollback is served on that node through its iptables rules. No
    traffic fails meanwhile. Deleting the Pod once the node is fixed completes the switch."""
    if not env.rolled_out("iptables"):  # the module's first test left it in nftables
        switch(env, "nftables", "iptables", LoadOptions(warmup=0.5, settle=0.5))
    refused = env.nodes[1]
    result = switch_with_rollback(env, "iptables", "nftables", refused, deadline=10)
    print(result.traffic())
    assert result.traffic_failures() == [], "\n".join(result.traffic_failures())
    # The node's agent rolled back after the deadline (10 s from its start) and said why.
    assert result.rolled_back_after is not None, result.at_rollback
    assert result.event.startswith("nftables never synced within 10s: "), result.event
    assert "Operation not permitted" in result.event, result.event
    assert result.event.endswith("; serving with iptables again"), result.event
    phases = {n["name"]: n for n in result.at_rollback.get("nodes", [])}
    assert phases[refused.name]["phase"] == "RolledBack", result.at_rollback
    assert "delete its agent Pod" in phases[refused.name]["message"], result.at_rollback
    assert "set spec.mode back to iptables" in phases[refused.name]["message"]
    cond = result.condition
    assert (cond.get("status"), cond.get("reason")) == ("False", "NodeRolledBack"), cond
    assert f"failed on node {refused.name}, which went back to iptables" in cond["message"], cond
    # The rollout stopped there: the node's nftables agent is not Ready, the other nodes did
    # not move while it was rolled back.
    assert result.agents_then[refused.name] == "nftables not ready", result.agents_then
    assert result.agents_held == result.agents_then, (result.agents_then, result.agents_held)
    held = {n["name"]: n["phase"] for n in result.held.get("nodes", [])}
    others = {n: p for n, p in held.items() if n != refused.name}
    assert held[refused.name] == "RolledBack" and set(others.values()) <= {"Switched", "Pending"}
    assert result.held.get("finishedAt") is None
    # Live, not frozen: a Service created after the rollback answers on that node, through
    # its iptables rules (nftables is refused there).
    assert result.late_served_after is not None, result.late_ip
    assert result.late_probe is not None and result.late_probe.failed == 0, result.late_probe
    assert result.late_in_old_rules, result.late_ip
    # Fixed and its Pod deleted: the node switches, and so do the others.
    assert result.recovered_after is not None
    assert env.leftovers("iptables") == {}
    assert result.finished.get("finishedAt"), result.finished
    assert {n["phase"] for n in result.finished["nodes"]} == {"Switched"}, result.finished


@pytest.mark.long  # 70-85 s each: `make test-long`, not `make test`
def test_setting_the_mode_back_rolls_a_stuck_node_back_and_it_keeps_serving(
    env: MigrationEnv,
) -> None:
    """The way out the ModeSwitch condition names when nothing rolls a node back
    (spec.modeSwitch.rollbackOnFailure false): while a node is Stuck in the switch to
    nftables, spec.mode is set back to iptables. Every node serves in iptables again (the stuck
    node too, while its kernel still refuses nftables), no traffic fails, and once the refusal
    is lifted the switch back finishes with every node Switched."""
    if not env.rolled_out("iptables"):
        switch(env, "nftables", "iptables", LoadOptions(warmup=0.5, settle=0.5))
    refused = env.nodes[2]
    result = revert_while_stuck(env, "iptables", "nftables", refused)
    assert result.traffic_failures() == [], "\n".join(result.traffic_failures())
    assert result.rolled_back_after is not None, result.back
    assert (result.back.get("fromMode"), result.back.get("toMode")) == ("nftables", "iptables")
    # Every node runs a Ready iptables agent again, although the refusal still held.
    assert env.rolled_out("iptables")
    assert result.finished.get("finishedAt"), result.finished
    assert {n["phase"] for n in result.finished["nodes"]} == {"Switched"}, result.finished
    assert env.leftovers("nftables") == {}
