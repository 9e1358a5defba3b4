"""nftables.localhostNodePorts end to end: the agent process on n1 (in n1's netns), configured
by its AgentConfiguration file, against the session's real apiserver with a NodePort Service
whose only endpoint is b2 (on n2). Off (the nftables default): the node's 127.0.0.1:<nodePort>
is refused and route_localnet stays 0. On (with nodePortAddresses empty, so in effect):
127.0.0.1:<nodePort> reaches b2, masqueraded to n1's address; the agent set route_localnet=1
through the file named by --route-localnet-file (as in its pod); the node's own address still
answers from n2. The packet-level guard (a martian to
127.0.0.1 from outside is dropped) is proven in tests/e2e/test_traffic_origin_kernel.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_harness import (
    BACKEND_PORT,
    AgentEnv,
    Svc,
    build_agent_env,
    endpoint_slice,
    service,
    service_port,
    wait_until,
    write_agent_config,
)

from kpx_cluster.controlplane import Cluster
from kpx_cluster.probe import ProbeResult

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[AgentEnv]:
    with build_agent_env(cluster, "nftables", start=False) as shared:
        yield shared


def route_localnet(env: AgentEnv) -> str:
    return env.topology.exec(env.n1, ["cat", ROUTE_LOCALNET], check=True).stdout.strip()


def from_n1(env: AgentEnv, host: str, port: int) -> ProbeResult:
    return env.probe(host, port, "tcp", count=3, timeout=1, source=env.n1)


def test_localhost_node_ports_off_by_default_and_on_when_opted_in(
    env: AgentEnv, agent_ns: str
) -> None:
    env.kube.apply(
        service("np", agent_ns, [service_port("tcp", 80, BACKEND_PORT)], type="NodePort"),
        endpoint_slice(
            "np-1",
            agent_ns,
            "np",
            env.backend_endpoints(4, ("b2",)),
            [("tcp", BACKEND_PORT, "TCP")],
        ),
    )
    node_port = Svc(env.kube.get("service", "np", agent_ns)).node_port("tcp")
    base = {"nodePortAddresses": []}  # every address: 127.0.0.1 may be a NodePort address

    # Off: nftables mode's default, as upstream's.
    default = write_agent_config(env.topology.tmpdir / "default.yaml", "nftables", extra=base)
    assert route_localnet(env) == "0"
    agent = env.start_agent("n1", config=default)
    wait_until(
        lambda: from_n1(env, env.n1.ipv4, node_port).backends == {"b2"}, 30, message=agent.log_tail
    )  # the Service is programmed
    off = from_n1(env, "127.0.0.1", node_port)
    assert off.refused == 3, off
    assert route_localnet(env) == "0"
    assert agent.stop() == 0, agent.log_tail()

    # On: kpx's opt-in.
    opt_in = write_agent_config(
        env.topology.tmpdir / "localhost.yaml",
        "nftables",
        extra={
            **base,
            "nftables": {"syncPeriod": "30s", "minSyncPeriod": "100ms", "localhostNodePorts": True},
        },
    )
    env.start_agent("n1", config=opt_in, extra_args=["--route-localnet-file", ROUTE_LOCALNET])
    on = from_n1(env, "127.0.0.1", node_port)
    assert on.backends == {"b2"} and on.failed == 0, on
    assert set(on.sources["b2"]) == {env.n1.ipv4}, on  # masqueraded to the node's address
    assert route_localnet(env) == "1"
    other = env.probe(env.n1.ipv4, node_port, "tcp", count=3, timeout=1, source=env.n2)
    assert other.backends == {"b2"} and other.failed == 0, other
