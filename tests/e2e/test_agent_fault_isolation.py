"""Issue #22 "no single object takes the dataplane down", with a real apiserver and agent.

Two Services on one load-balancer IP and port with overlapping loadBalancerSourceRanges, the
second created after the first was programmed (a second tenant), once made the kernel refuse
every sync on every node until the pair was deleted. Now the pair is programmed (a source gets
through when both Services allow it), and a Service created afterwards answers.
"""

from __future__ import annotations

import pytest
from agent_harness import BACKEND_PORT, AgentEnv, service_port
from test_agent_nftables import BOTH, assert_reaches, make_service

AGENT_MODE = "nftables"
pytestmark = [pytest.mark.e2e, pytest.mark.netns]

LB_IP = "10.251.0.22"
HTTP = [service_port("tcp", 80, BACKEND_PORT, "TCP")]


def load_balancer(env: AgentEnv, ns: str, name: str, *ranges: str) -> None:
    make_service(
        env,
        ns,
        name,
        HTTP,
        type="LoadBalancer",
        extra_spec={"loadBalancerSourceRanges": list(ranges)},
    )
    env.kube.patch_status(
        "service", name, {"status": {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}}, ns
    )


def test_poison_pair_of_a_second_tenant_blocks_no_later_change(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    agent = agent_env.agent
    assert agent is not None
    failures_before = agent.metric("kpx_sync_failures_total", mode="nftables") or 0
    load_balancer(agent_env, agent_ns, "tenant-a", "10.0.0.0/8")
    assert_reaches(agent_env, LB_IP, 80, "tcp", BOTH)
    load_balancer(agent_env, agent_ns, "tenant-b", "10.244.0.0/16")  # the client's, inside
    later = make_service(
        agent_env, agent_ns, "later", [service_port("tcp", 80, BACKEND_PORT, "TCP")]
    )
    assert_reaches(agent_env, later.ip(), 80, "tcp", BOTH)
    assert_reaches(agent_env, LB_IP, 80, "tcp", BOTH)
    failures = agent.metric("kpx_sync_failures_total", mode="nftables") or 0
    assert failures == failures_before, agent.log_tail()
