"""A half-open apiserver connection does not freeze the agent's view.

The agent on n1 reaches the apiserver through a relay on the node's loopback
(`Topology.expose_host_port`). The test blackholes every connection that exists at one moment
(an nftables table inside n1's network namespace drops the packets of the flows conntrack knew
before it, in both directions), while new connections pass: the agent's watches go silent
without any error, as when the apiserver's host is lost or a NAT entry is dropped. A Service
created meanwhile must reach n1's kernel within the agent's watch idle timeout and a margin,
while the old connections stay blackholed: only the agent dropping them and watching again from
its last resourceVersion on a new connection can bring it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from agent_harness import (
    BACKEND_PORT,
    AgentEnv,
    endpoint_slice,
    nft_ruleset,
    service,
    service_port,
    wait_until,
)

AGENT_MODE = "nftables"
pytestmark = [pytest.mark.e2e, pytest.mark.netns]

IDLE_TIMEOUT = 5.0  # the agent's --watch-idle-timeout in this test
MARGIN = 10.0  # a rewatch may first pick a pooled connection that is blackholed too
TABLE = "e2e_blackhole"
PORTS = [service_port("tcp", 80, BACKEND_PORT, "TCP")]


def blackhole_ruleset(port: int) -> str:
    """New flows to the apiserver relay get conntrack mark 1; the others (those that existed
    when the table was added) lose every packet, both ways."""
    return f"""
table inet {TABLE} {{
    counter dropped {{ }}
    chain out {{
        type filter hook output priority 0; policy accept;
        tcp dport {port} ct state new ct mark set 0x1
        tcp dport {port} ct mark != 0x1 counter name dropped drop
        tcp sport {port} ct mark != 0x1 counter name dropped drop
    }}
}}
"""


def dropped_packets(env: AgentEnv) -> int:
    out = env.topology.exec(env.n1, ["nft", "list", "counter", "inet", TABLE, "dropped"])
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split("packets")[1].split()[0])


@pytest.fixture
def fast_agent(agent_env: AgentEnv) -> Iterator[AgentEnv]:
    """The agent on n1, restarted with a short watch idle timeout."""
    assert agent_env.agent is not None
    agent_env.agent.stop()
    agent_env.start_agent("n1", extra_args=["--watch-idle-timeout", str(IDLE_TIMEOUT)])
    assert agent_env.agent is not None
    agent_env.agent.wait_healthy()
    yield agent_env


def test_blackholed_watch_connection_is_dropped_and_a_later_change_reaches_the_kernel(
    fast_agent: AgentEnv, agent_ns: str
) -> None:
    env = fast_agent
    agent = env.agent
    assert agent is not None
    env.kube.apply(service("before", agent_ns, PORTS))
    before = env.kube.get("service", "before", agent_ns)["spec"]["clusterIP"]
    wait_until(
        lambda: before in nft_ruleset(env.topology, env.n1),
        10,
        message=lambda: f"first Service never programmed:\n{agent.log_tail()}",
    )
    idle_before = agent.metric("kpx_watch_idle_timeouts_total", resource="services") or 0.0

    port = env.cluster.apiserver_port
    added = env.topology.exec(env.n1, ["nft", "-f", "-"], input=blackhole_ruleset(port))
    assert added.returncode == 0, added.stderr
    try:
        started = time.monotonic()
        endpoints = env.backend_endpoints(4, ["b1"])
        slice_ = endpoint_slice(
            "during-v4", agent_ns, "during", endpoints, [("tcp", BACKEND_PORT, "TCP")]
        )
        env.kube.apply(service("during", agent_ns, PORTS), slice_)
        during = env.kube.get("service", "during", agent_ns)["spec"]["clusterIP"]
        limit = IDLE_TIMEOUT + MARGIN
        wait_until(
            lambda: during in nft_ruleset(env.topology, env.n1),
            limit,
            interval=0.2,
            message=lambda: f"not programmed within {limit} s:\n{agent.log_tail()}",
        )
        took = time.monotonic() - started
        # The old connections really were blackholed (the event sent on them was dropped) and
        # still are: the change came over a new connection the agent opened by itself.
        assert dropped_packets(env) > 0
        idle_after = agent.metric("kpx_watch_idle_timeouts_total", resource="services") or 0.0
        assert idle_after > idle_before
        print(f"change programmed {took:.1f} s after the blackhole (idle timeout {IDLE_TIMEOUT})")
        assert agent.healthz_status() == 200
    finally:
        env.topology.exec(env.n1, ["nft", "delete", "table", "inet", TABLE])
