"""spec.conntrack applied by a real agent in a node network namespace the test creates.

The timeouts and tcp_be_liberal are per network namespace: the agent sets them in its node's
namespace and the test reads them back there, while the host's stay as they were.
nf_conntrack_max and hashsize are global to the host: here the agent is not in the host's
network namespace, so it must neither write them when they already suffice nor when they would
need a raise; the latter is reported (log and metrics), and the host's values are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import AgentEnv, build_agent_env, start_agent, write_agent_config

from kpx_cluster.controlplane import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

NETFILTER = Path("/proc/sys/net/netfilter")
PER_NETNS = {
    "nf_conntrack_tcp_timeout_established": ("tcpEstablishedTimeout", "7h", 25200),
    "nf_conntrack_tcp_timeout_close_wait": ("tcpCloseWaitTimeout", "90s", 90),
    "nf_conntrack_udp_timeout": ("udpTimeout", "33s", 33),
    "nf_conntrack_udp_timeout_stream": ("udpStreamTimeout", "150s", 150),
    "nf_conntrack_tcp_be_liberal": ("tcpBeLiberal", True, 1),
}
GLOBAL = ("nf_conntrack_max",)


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[AgentEnv]:
    with build_agent_env(cluster, start=False) as shared:
        yield shared


def host_values() -> dict[str, str]:
    return {name: (NETFILTER / name).read_text() for name in (*PER_NETNS, *GLOBAL)} | {
        "hashsize": Path("/sys/module/nf_conntrack/parameters/hashsize").read_text()
    }


def node_value(env: AgentEnv, node: str, name: str) -> int:
    out = env.topology.exec(env.nodes[node], ["cat", str(NETFILTER / name)], check=True)
    return int(out.stdout)


def config(env: AgentEnv, name: str, **conntrack: object) -> Path:
    return write_agent_config(env.topology.tmpdir / name, extra={"conntrack": conntrack})


def test_agent_sets_per_namespace_settings_in_its_node_only(env: AgentEnv) -> None:
    before = host_values()
    current_max = int(before["nf_conntrack_max"])
    # A table size the host already has (so nothing global is needed), and every timeout.
    settings: dict[str, object] = {"maxPerCore": 1, "min": min(current_max, 1024)}
    settings |= {field: value for field, value, _ in PER_NETNS.values()}
    agent = start_agent(
        env.topology, env.n1, env.kubeconfig, config=config(env, "ct-all.yaml", **settings)
    )
    try:
        for name, (_, _, expected) in PER_NETNS.items():
            assert node_value(env, "n1", name) == expected, name
        assert agent.metric("kpx_conntrack_settings_not_applied") == 0
        log = agent.log()
        assert "conntrack: set nf_conntrack_tcp_timeout_established to 25200" in log
        assert "nf_conntrack_max" not in log  # already enough: not written, not reported
        # The other node's namespace and the host keep their values.
        assert node_value(env, "n2", "nf_conntrack_tcp_timeout_established") != 25200
        assert host_values() == before
    finally:
        agent.stop()


def test_a_global_raise_outside_the_host_namespace_is_reported(env: AgentEnv) -> None:
    before = host_values()
    too_big = int(before["nf_conntrack_max"]) + 4096  # more than the host has: a raise
    agent = start_agent(
        env.topology,
        env.n2,
        env.kubeconfig,
        config=config(
            env,
            "ct-raise.yaml",
            maxPerCore=0,
            min=0,
            tcpEstablishedTimeout="5h",
            tcpCloseWaitTimeout="0s",
        ),
    )
    agent.stop()
    assert node_value(env, "n2", "nf_conntrack_tcp_timeout_established") == 5 * 3600
    # maxPerCore = the raise itself (per CPU count); min too: whatever the CPUs, > current.
    raise_config = config(
        env,
        "ct-raise2.yaml",
        maxPerCore=too_big,
        min=too_big,
        tcpEstablishedTimeout="0s",
        tcpCloseWaitTimeout="0s",
    )
    agent = start_agent(env.topology, env.n2, env.kubeconfig, config=raise_config)
    try:
        assert agent.metric("kpx_conntrack_settings_not_applied") == 1
        failures = agent.metric("kpx_conntrack_apply_failures_total", setting="nf_conntrack_max")
        assert failures == 1
        assert "not in the host's network namespace" in agent.log()
        assert agent.healthz_status() == 200  # proxying goes on
        assert host_values() == before
    finally:
        agent.stop()
