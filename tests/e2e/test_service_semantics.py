"""Issue "Full Service semantics ... proven by one shared packet test matrix".

Every test here runs once per proxy mode (nftables and iptables, each while it is in
`kpx_agent.backends.REGISTRY`) against the session's real apiserver: one Topology per mode
(module-scoped `env`) with agents on BOTH nodes n1 and n2, backends b1 (on n1) and b2 (on n2),
clients `client` and `client2` (pods on n1) and the node netns themselves. Services have no
selector: the tests write the EndpointSlices (there is no kubelet). Every assertion is about
real packets (TCP and UDP, IPv4 and IPv6 where it applies) and what the echo backends saw:
which backend answered and the client address it saw (`ProbeResult.sources`).

"Dropped" always means every try timed out (or, for a client in a node's own netns, was refused
with EPERM by that node's netfilter): nothing answered, nothing was refused (a reject, an RST or
an ICMP unreachable would show up as "refused" or another error).

SCTP is not covered: the echo server and the probe speak only TCP and UDP.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from agent_harness import (
    BACKEND_PORT,
    AgentEnv,
    AgentProcess,
    Obj,
    Svc,
    build_agent_env,
    endpoint,
    endpoint_slice,
    first_seen,
    iptables_chains,
    kernel_rules,
    kpx_tables,
    run_cleanup,
    service,
    service_port,
    start_agent,
    start_udp_socket_watch,
    wait_until,
    write_agent_config,
)

from kpx_agent.backends import REGISTRY
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Pod, Target
from kpx_cluster.probe import ProbeResult, format_target, probe

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

MODES = [m for m in ("nftables", "iptables") if m in REGISTRY]
BOTH = {"b1", "b2"}
PROTOS = ("tcp", "udp")
TCP_UDP = [
    service_port("tcp", 80, BACKEND_PORT, "TCP"),
    service_port("udp", 80, BACKEND_PORT, "UDP"),
]
UDP_ONLY = [service_port("udp", 80, BACKEND_PORT, "UDP")]
ZONE_LABEL = "topology.kubernetes.io/zone"
LB_V4_NET, LB_V6_NET = "10.251.0.0/16", "fd00:251::/64"  # load-balancer IPs of these tests
# Seconds to wait for a long-lived UDP socket to reach its new backend after an EndpointSlice
# write: generous for a busy machine. Without the agent's conntrack cleanup the socket stays on
# its stale entry for good (its own datagrams keep the entry alive), so any wait tells them apart.
UDP_SWITCH_WAIT = 20.0
# Seconds for the agent's conntrack cleaner to delete the UDP entries of a sync's tries before
# a UDP check's final tries (it takes milliseconds; a busy CI machine delays it).
UDP_CLEANER_SETTLE_S = 1.0

family_param = pytest.mark.parametrize("family", [4, 6], ids=["v4", "v6"])


# ---- the environment: one per mode, agents on n1 and n2 -----------------------------------------


@pytest.fixture(scope="module", params=MODES)
def env(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[AgentEnv]:
    if os.geteuid() != 0:
        pytest.fail("the agent environment needs root (network namespaces)", pytrace=False)
    with build_agent_env(cluster, str(request.param)) as shared:
        shared.pods["client2"] = shared.topology.add_pod(shared.n1, "client2")
        shared.start_agent("n2")
        # The nodes have no default route; give them one for the load-balancer IPs, each via
        # the other node. So a load-balancer IP packet a node fails to drop is forwarded to the
        # other node, whose agent answers it (instead of an unreachable-route ICMP error).
        for node, other in ((shared.n1, shared.n2), (shared.n2, shared.n1)):
            for net, via in ((LB_V4_NET, other.ipv4), (LB_V6_NET, other.ipv6)):
                route = ["ip", "route", "replace", net, "via", via]
                shared.topology.exec(node, route, check=True)
        yield shared


def agent_on(env: AgentEnv, node: str) -> AgentProcess:
    if node == "n1":
        assert env.agent is not None
        return env.agent
    return next(a for a in env.extra_agents if a.node.name == node and a.alive())


def diagnostics(env: AgentEnv) -> str:
    out = []
    for agent in [env.agent, *env.extra_agents]:
        if agent is not None:
            out.append(f"--- agent on {agent.node.name} ({env.mode}):\n{agent.log_tail(12)}")
    return "\n".join(out)


# ---- addresses -----------------------------------------------------------------------------------


def ip_of(target: Node | Pod, family: int) -> str:
    return str(target.ipv4 if family == 4 else target.ipv6)


def gateway_of(node: Node, family: int) -> str:
    """The node's cbr0 address: what a masquerade towards one of its own pods rewrites to."""
    return node.gateway_v4 if family == 4 else node.gateway_v6


_SEQUENCE = itertools.count(1)


def lb_ips() -> dict[int, str]:
    """A load-balancer IP per family (inside LB_V4_NET / LB_V6_NET) used by no other test."""
    n = next(_SEQUENCE)
    return {4: f"10.251.{n // 200}.{n % 200 + 1}", 6: f"fd00:251::1:{n:x}"}


def static_cluster_ips() -> dict[int, str]:
    """A cluster IP per family used by no other Service: from the low band of the Service
    CIDRs (10.96.0.0/16, fd00:96::/112), which the apiserver keeps for static choices."""
    n = 20 + next(_SEQUENCE) % 200
    return {4: f"10.96.0.{n}", 6: f"fd00:96::{n:x}"}


# ---- Services and EndpointSlices -----------------------------------------------------------------


Endpoints = Callable[[int], list[Obj]]  # family -> endpoints of that family's slice


def on(env: AgentEnv, *names: str, **conditions: Any) -> Endpoints:
    """Endpoints for these backend pods, every one with the same conditions."""

    def build(family: int) -> list[Obj]:
        return [
            endpoint(ip_of(env.pods[n], family), env.pods[n].node.name, **conditions) for n in names
        ]

    return build


def slice_ports(ports: Sequence[Obj]) -> list[tuple[str, int, str]]:
    return [(str(p["name"]), int(p["targetPort"]), str(p["protocol"])) for p in ports]


def slices(
    ns: str,
    name: str,
    endpoints: Endpoints,
    ports: Sequence[Obj] = TCP_UDP,
    families: Sequence[int] = (4, 6),
) -> list[Obj]:
    return [
        endpoint_slice(
            f"{name}-v{fam}",
            ns,
            name,
            endpoints(fam),
            slice_ports(ports),
            address_type=f"IPv{fam}",
        )
        for fam in families
    ]


def make_service(
    env: AgentEnv,
    ns: str,
    name: str,
    endpoints: Endpoints | None,
    ports: Sequence[Obj] = TCP_UDP,
    families: Sequence[int] = (4, 6),
    **kwargs: Any,
) -> Svc:
    """A selector-less Service (dual-stack unless told otherwise) and, unless `endpoints` is
    None, one EndpointSlice per family."""
    kwargs.setdefault("ip_family_policy", "PreferDualStack")
    objs = [service(name, ns, ports, **kwargs)]
    if endpoints is not None:
        objs += slices(ns, name, endpoints, ports, families)
    env.kube.apply(*objs)
    return Svc(env.kube.get("service", name, ns))


def set_lb_ingress(env: AgentEnv, ns: str, name: str, ips: Sequence[str]) -> None:
    status = {"loadBalancer": {"ingress": [{"ip": ip} for ip in ips]}}
    env.kube.patch_status("service", name, {"status": status}, ns)


# ---- packets -------------------------------------------------------------------------------------


def send(
    env: AgentEnv,
    host: str,
    port: int,
    proto: str,
    source: Target | None = None,
    count: int = 8,
    timeout: float = 0.5,
) -> ProbeResult:
    return probe(env.topology, source or env.client, host, port, proto, count, timeout)


def where(source: Target | None) -> str:
    return getattr(source, "name", None) or str(source or "client")


def assert_reaches(
    env: AgentEnv,
    host: str,
    port: int,
    proto: str,
    expected: set[str],
    source: Target | None = None,
    timeout: float = 8.0,
) -> ProbeResult:
    """Wait until every try is answered by exactly the `expected` backends; then 20 more tries
    must be too. The result (with `sources`) of those 20."""
    target = f"{proto} {format_target(host, port)} from {where(source)}"
    last: list[ProbeResult] = []

    def ok() -> bool:
        r = send(env, host, port, proto, source, count=8, timeout=0.5)
        last[:] = [r]
        return r.backends == expected and r.failed == 0

    wait_until(
        ok,
        timeout,
        interval=0.1,
        message=lambda: (
            f"{target}: not answered by {sorted(expected)}: {last[-1]}\n" + diagnostics(env)
        ),
    )
    if proto == "udp":
        # Tries made while the rules changed left conntrack entries to the old endpoints; the
        # agent deletes them right after the sync, off the programming path
        # (conntrack/cleaner.py), so a try that reuses one of their source ports meanwhile
        # follows one (seen in CI: 1 of 20 to the endpoint a VIP had just lost). Let the
        # cleaner run first, as test_agent_nftables.assert_reaches does.
        time.sleep(UDP_CLEANER_SETTLE_S)
    result = send(env, host, port, proto, source, count=20, timeout=1.0)
    assert result.failed == 0 and result.backends == expected, f"{target}: {result}"
    return result


def assert_sources(result: ProbeResult, expected: set[str] | dict[str, str], what: str) -> None:
    """The client addresses the backends saw: `expected` for all of them, or per backend."""
    if isinstance(expected, dict):
        seen_by = {name: set(srcs) for name, srcs in result.sources.items()}
        wanted = {name: {src} for name, src in expected.items()}
        assert seen_by == wanted, f"{what}: the backends saw {seen_by}, expected {wanted}"
        return
    seen = {s for srcs in result.sources.values() for s in srcs}
    assert seen == expected, f"{what}: the backends saw {seen}, expected {expected}: {result}"


# How a sender sees its own packet dropped by netfilter in its own netns (a node's client):
# UDP's send() fails with EPERM at once; TCP retransmits its SYN until the timeout.
LOCAL_DROP = "Operation not permitted"


def dropped_tries(result: ProbeResult) -> int:
    return result.timeout + result.errors.get(LOCAL_DROP, 0)


def assert_dropped(
    env: AgentEnv,
    host: str,
    port: int,
    proto: str,
    source: Target | None = None,
    timeout: float = 8.0,
) -> None:
    """Wait until every try is dropped: it times out (or, sent from a node, its own netfilter
    refuses it with EPERM), nothing answers, nothing is refused; then check again."""
    target = f"{proto} {format_target(host, port)} from {where(source)}"
    last: list[ProbeResult] = []

    def dropped() -> bool:
        r = send(env, host, port, proto, source, count=2, timeout=0.25)
        last[:] = [r]
        return dropped_tries(r) == 2

    wait_until(
        dropped,
        timeout,
        interval=0.1,
        message=lambda: f"{target}: not dropped: {last[-1]}\n{diagnostics(env)}",
    )
    result = send(env, host, port, proto, source, count=4, timeout=0.25)
    assert dropped_tries(result) == 4, f"{target}: expected every try dropped: {result}"


def wait_programmed(env: AgentEnv, node: Node, text: str, timeout: float = 8.0) -> None:
    """Wait until `text` (say a VIP) appears in the rules of `node`'s netns."""
    wait_until(
        lambda: text in kernel_rules(env.topology, node),
        timeout,
        interval=0.1,
        message=lambda: f"{text} never programmed on {node.name}\n{diagnostics(env)}",
    )


def wait_answered(
    env: AgentEnv, host: str, port: int, proto: str, source: Target | None = None
) -> None:
    """Wait until every try is answered, by any backend."""
    last: list[ProbeResult] = []

    def answered() -> bool:
        last[:] = [send(env, host, port, proto, source, count=3)]
        return last[0].answered == 3

    wait_until(
        answered,
        8.0,
        interval=0.1,
        message=lambda: (
            f"{proto} {format_target(host, port)} never answered: {last}\n" + diagnostics(env)
        ),
    )


# ---- 1. session affinity -------------------------------------------------------------------------


def test_session_affinity_client_ip_sticks_until_turned_off(env: AgentEnv, agent_ns: str) -> None:
    affinity = {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
    }
    svc = make_service(env, agent_ns, "sticky", on(env, "b1", "b2"), extra_spec=affinity)
    for family in (4, 6):
        vip = svc.ip(family)
        for proto in PROTOS:
            what = f"{proto} {format_target(vip, 80)}"
            wait_answered(env, vip, 80, proto)
            first = send(env, vip, 80, proto, count=20)
            assert first.failed == 0 and len(first.backends) == 1, f"{what}: {first}"
            again = send(env, vip, 80, proto, count=20)
            assert again.failed == 0 and again.backends == first.backends, f"{what}: {again}"

    env.kube.apply(service("sticky", agent_ns, TCP_UDP, ip_family_policy="PreferDualStack"))
    for family in (4, 6):
        for proto in PROTOS:
            assert_reaches(env, svc.ip(family), 80, proto, BOTH)


# ---- 2. externalTrafficPolicy --------------------------------------------------------------------


def etp_service(ns: str, policy: str, extra: dict[str, Any] | None = None) -> Obj:
    spec = {"externalTrafficPolicy": policy, **(extra or {})}
    return service(
        "etp",
        ns,
        TCP_UDP,
        type="LoadBalancer",
        ip_family_policy="PreferDualStack",
        extra_spec=spec,
    )


def outside_host(env: AgentEnv) -> Node:
    """A host on the fabric that is neither a node of the cluster nor a pod (a node netns
    `outside`, no Node object, no agent, no pods), routing the load-balancer ranges via n1:
    external traffic."""
    host = env.topology.nodes.get("outside") or env.topology.add_node("outside")
    for net, via in ((LB_V4_NET, env.n1.ipv4), (LB_V6_NET, env.n1.ipv6)):
        env.topology.exec(host, ["ip", "route", "replace", net, "via", via], check=True)
    return host


@family_param
def test_external_traffic_policy_local_drops_external_and_short_circuits_local_traffic(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    """externalTrafficPolicy Local as upstream: external traffic keeps its source and is
    dropped on a node without a local endpoint; traffic from a pod of that node (detectLocal:
    ClusterCIDR here) or from the node itself goes to every cluster endpoint instead (the
    "short circuit": in-cluster clients of a load-balancer IP keep working), the pod keeping
    its source, the node masqueraded."""
    lb = lb_ips()
    env.kube.apply(etp_service(agent_ns, "Local"), *slices(agent_ns, "etp", on(env, "b2")))
    svc = Svc(env.kube.get("service", "etp", agent_ns))
    set_lb_ingress(env, agent_ns, "etp", [lb[4], lb[6]])
    outside = outside_host(env)
    client, n1, n2 = ip_of(env.client, family), ip_of(env.n1, family), ip_of(env.n2, family)
    external = ip_of(outside, family)
    for proto in PROTOS:
        node_port = svc.node_port(proto)
        # n2 has the only endpoint: it serves, and b2 sees the external client itself.
        result = assert_reaches(env, n2, node_port, proto, {"b2"}, source=outside)
        assert_sources(result, {external}, f"ETP Local {proto} via n2's NodePort")
        # n1 has none: external traffic is dropped there (a reject, or a forward to b2,
        # would both be wrong), at its NodePort and at the load-balancer IP (were it not
        # dropped, n1 would forward it to n2 by the route the fixture set, and n2 answer).
        assert_dropped(env, n1, node_port, proto, source=outside)
        assert_dropped(env, lb[family], 80, proto, source=outside)
        # A pod on n1 is short-circuited to the cluster endpoints, keeping its source ...
        for host, port in ((n1, node_port), (lb[family], 80)):
            result = assert_reaches(env, host, port, proto, {"b2"})
            assert_sources(result, {client}, f"ETP Local {proto} {host} from a pod of n1")
        # ... and so is n1 itself, masqueraded (its source is a node address).
        result = assert_reaches(env, lb[family], 80, proto, {"b2"}, source=env.n1)
        assert_sources(result, {n1}, f"ETP Local {proto} {lb[family]} from n1")

    # externalTrafficPolicy: Cluster - n1 forwards to b2 and masquerades (b2 sees n1).
    env.kube.apply(etp_service(agent_ns, "Cluster"))
    tcp_port = svc.node_port("tcp")

    def masquerading() -> bool:  # new TCP connections follow the new rules at once
        seen = send(env, n1, tcp_port, "tcp", count=2).sources.get("b2")
        return bool(seen) and set(seen) == {n1}

    wait_until(
        masquerading,
        10.0,
        message=lambda: f"ETP Cluster never programmed on n1\n{diagnostics(env)}",
    )
    # A policy change leaves existing flows as they are (as upstream: conntrack is cleared for
    # removed endpoints only). The UDP probes above left flows that a new probe socket may
    # reuse by chance (same source port): clear them, so each try below is a new flow.
    env.topology.exec(env.n1, ["conntrack", "-D", "-p", "udp"], check=False)
    for proto in PROTOS:
        result = assert_reaches(env, n1, svc.node_port(proto), proto, {"b2"})
        assert_sources(result, {n1}, f"ETP Cluster {proto} via n1's NodePort")
        result = assert_reaches(env, lb[family], 80, proto, {"b2"})
        assert_sources(result, {n1}, f"ETP Cluster {proto} via the load-balancer IP")
        result = assert_reaches(env, n1, svc.node_port(proto), proto, {"b2"}, source=outside)
        assert_sources(result, {n1}, f"ETP Cluster {proto} from outside via n1's NodePort")


def test_detect_local_from_the_configuration_file_decides_masquerade_and_short_circuit(
    env: AgentEnv, agent_ns: str
) -> None:
    """detectLocal, changed live in the agents' configuration file, reaches the rules: with
    InterfaceNamePrefix naming no interface here, the pod on n1's cbr0 is not local any more:
    its traffic to a cluster IP is masqueraded (b2 sees n1) and its traffic to an
    externalTrafficPolicy Local load-balancer IP without a local endpoint is dropped (no short
    circuit); with BridgeInterface cbr0 it is local again."""
    lb = lb_ips()
    svc = make_service(env, agent_ns, "dl", on(env, "b2"), families=(4,))
    env.kube.apply(etp_service(agent_ns, "Local"), *slices(agent_ns, "etp", on(env, "b2")))
    set_lb_ingress(env, agent_ns, "etp", [lb[4], lb[6]])
    client, n1, vip = env.client.ipv4, env.n1.ipv4, svc.ip(4)

    def seen(host: str) -> set[str]:
        result = send(env, host, 80, "tcp", count=3, timeout=0.5)
        return {src for srcs in result.sources.values() for src in srcs}

    def becomes(host: str, sources: set[str], what: str) -> None:
        wait_until(
            lambda: seen(host) == sources,
            10.0,
            interval=0.2,
            message=lambda: f"{what}: b2 saw {seen(host)}, not {sources}\n{diagnostics(env)}",
        )

    becomes(vip, {client}, "ClusterCIDR: the pod is local")
    becomes(lb[4], {client}, "ClusterCIDR: the pod is short-circuited")
    original = env.config.read_text()
    try:
        for detect, local in (
            ({"mode": "InterfaceNamePrefix", "interfaceNamePrefix": "nosuchif"}, False),
            ({"mode": "BridgeInterface", "bridgeInterface": "cbr0"}, True),
        ):
            write_agent_config(env.config, env.mode, extra={"detectLocal": detect})
            what = f"detectLocal {detect}"
            becomes(vip, {client} if local else {n1}, what)
            if local:
                becomes(lb[4], {client}, what)
            else:
                assert_dropped(env, lb[4], 80, "tcp")
    finally:
        env.config.write_text(original)
    becomes(vip, {client}, "ClusterCIDR again")


def free_node_port(env: AgentEnv) -> int:
    """A NodePort no Service of the cluster holds (the module's Services hold random ones)."""
    services = env.kube.client.get("/api/v1/services")["items"]
    used = {p.get("nodePort") for s in services for p in s["spec"].get("ports", [])}
    used |= {s["spec"].get("healthCheckNodePort") for s in services}
    return random.choice([p for p in range(32000, 32768) if p not in used])


def test_health_check_node_port_reports_local_endpoints(env: AgentEnv, agent_ns: str) -> None:
    """The healthCheckNodePort of a LoadBalancer Service with externalTrafficPolicy Local,
    asked from inside each node: 200 and the local endpoint count where there is one (a
    dual-stack pod is one endpoint), 503 elsewhere; closed once the policy is Cluster."""
    hc_port = free_node_port(env)
    local = etp_service(agent_ns, "Local", {"healthCheckNodePort": hc_port})
    env.kube.apply(local, *slices(agent_ns, "etp", on(env, "b2")))
    spec = env.kube.get("service", "etp", agent_ns)["spec"]
    assert spec["healthCheckNodePort"] == hc_port, spec

    def health(node: str) -> tuple[int, str]:
        return agent_on(env, node).http_get(f"127.0.0.1:{hc_port}", "/", timeout=1.0)

    def health_body(node: str, status: int) -> Obj:
        last: list[tuple[int, str]] = []

        def check() -> bool:
            last[:] = [health(node)]
            return last[0][0] == status

        wait_until(
            check,
            8.0,
            interval=0.2,
            message=lambda: f"health check on {node} never {status}: {last}\n{diagnostics(env)}",
        )
        body: Obj = json.loads(last[0][1])
        return body

    n2_body = health_body("n2", 200)
    assert n2_body["localEndpoints"] == 1, f"n2 (b2, one dual-stack pod): {n2_body}"
    n1_body = health_body("n1", 503)
    assert n1_body["localEndpoints"] == 0, f"n1 (no local endpoint): {n1_body}"

    env.kube.apply(etp_service(agent_ns, "Cluster"))
    wait_until(
        lambda: health("n2")[0] == 0, 8.0, message="health check still served after ETP Cluster"
    )


# ---- 3. internalTrafficPolicy --------------------------------------------------------------------


@family_param
def test_internal_traffic_policy_local_uses_only_local_endpoints(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    itp = {"internalTrafficPolicy": "Local"}
    svc = make_service(env, agent_ns, "itp", on(env, "b2"), extra_spec=itp)
    vip = svc.ip(family)
    wait_programmed(env, env.n1, vip)
    for proto in PROTOS:
        # n2's agent sends its own node's traffic to its local b2 ...
        assert_reaches(env, vip, 80, proto, {"b2"}, source=env.n2)
        # ... n1 has no local endpoint: dropped, not rejected, not sent to n2.
        assert_dropped(env, vip, 80, proto)

    env.kube.apply(*slices(agent_ns, "itp", on(env, "b1", "b2")))
    for proto in PROTOS:
        assert_reaches(env, vip, 80, proto, {"b1"})
        assert_reaches(env, vip, 80, proto, {"b2"}, source=env.n2)

    # No endpoint anywhere: rejected, not dropped (upstream drops only while endpoints exist
    # elsewhere). A TCP socket sees an ICMPv6 error to its first SYN only when connect() no
    # longer holds it (on these veths it often does): the retransmitted SYN, 1 s later, is
    # refused for sure, hence the 2.5 s try.
    env.kube.apply(*slices(agent_ns, "itp", on(env)))
    for proto in PROTOS:
        wait_until(
            lambda proto=proto: send(env, vip, 80, proto, count=1, timeout=2.5).refused == 1,
            10.0,
            message=lambda proto=proto: f"{proto} {vip} never refused\n{diagnostics(env)}",
        )


# ---- 4. topology (trafficDistribution: PreferClose, zone hints) ----------------------------------


def test_prefer_close_follows_zone_hints_and_falls_back_without_them(
    env: AgentEnv, agent_ns: str
) -> None:
    kube = env.kube
    kube.label("node", "n1", {ZONE_LABEL: "zone-a"})
    kube.label("node", "n2", {ZONE_LABEL: "zone-b"})
    try:

        def hinted(hint_b2: bool) -> Endpoints:
            def build(family: int) -> list[Obj]:
                b1, b2 = on(env, "b1", "b2")(family)
                b1["zone"], b2["zone"] = "zone-a", "zone-b"
                b1["hints"] = {"forZones": [{"name": "zone-a"}]}
                if hint_b2:
                    b2["hints"] = {"forZones": [{"name": "zone-b"}]}
                return [b1, b2]

            return build

        svc = make_service(
            env,
            agent_ns,
            "close",
            hinted(True),
            extra_spec={"trafficDistribution": "PreferClose"},
        )
        for family in (4, 6):
            for proto in PROTOS:
                assert_reaches(env, svc.ip(family), 80, proto, {"b1"})  # client on n1: zone-a
            assert_reaches(env, svc.ip(family), 80, "tcp", {"b2"}, source=env.n2)  # zone-b

        # One endpoint without hints: hints are ignored altogether (upstream's fallback).
        kube.apply(*slices(agent_ns, "close", hinted(False)))
        for family in (4, 6):
            for proto in PROTOS:
                assert_reaches(env, svc.ip(family), 80, proto, BOTH)
    finally:
        kube.label("node", "n1", {ZONE_LABEL: None})
        kube.label("node", "n2", {ZONE_LABEL: None})


# ---- 5. terminating endpoints --------------------------------------------------------------------


@family_param
def test_serving_terminating_endpoints_are_used_only_when_none_is_ready(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    serving = {"ready": False, "serving": True, "terminating": True}
    gone = {"ready": False, "serving": False, "terminating": True}

    def eps(b1: dict[str, bool], b2: dict[str, bool]) -> Endpoints:
        return lambda fam: [*on(env, "b1", **b1)(fam), *on(env, "b2", **b2)(fam)]

    svc = make_service(env, agent_ns, "term", eps(serving, gone))
    vip = svc.ip(family)
    for proto in PROTOS:
        assert_reaches(env, vip, 80, proto, {"b1"})
    env.kube.apply(*slices(agent_ns, "term", eps(gone, serving)))
    for proto in PROTOS:
        assert_reaches(env, vip, 80, proto, {"b2"})
    # A ready endpoint wins over serving-and-terminating ones.
    env.kube.apply(*slices(agent_ns, "term", eps({"ready": True}, serving)))
    for proto in PROTOS:
        assert_reaches(env, vip, 80, proto, {"b1"})


# ---- 6. loadBalancerSourceRanges -----------------------------------------------------------------


@family_param
def test_load_balancer_source_ranges_admit_only_listed_clients(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    lb = lb_ips()
    ranges = [f"{env.client.ipv4}/32", f"{env.client.ipv6}/128"]
    make_service(
        env,
        agent_ns,
        "fw",
        on(env, "b1", "b2"),
        type="LoadBalancer",
        extra_spec={"loadBalancerSourceRanges": ranges},
    )
    set_lb_ingress(env, agent_ns, "fw", [lb[4], lb[6]])
    for proto in PROTOS:
        assert_reaches(env, lb[family], 80, proto, BOTH)  # `client`: in the range
        assert_dropped(env, lb[family], 80, proto, source=env.pods["client2"])  # not in it


@family_param
def test_load_balancer_source_ranges_apply_to_node_originated_traffic(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    """A node's own traffic to a load-balancer IP is subject to the source ranges too (as
    upstream's firewall check in the output path does): n2 is not in `fw`'s ranges, it is in
    `fw-node`'s."""
    lb, lb_node = lb_ips(), lb_ips()
    for name, ips, ranges in (
        ("fw", lb, [f"{env.client.ipv4}/32", f"{env.client.ipv6}/128"]),
        ("fw-node", lb_node, [f"{env.n2.ipv4}/32", f"{env.n2.ipv6}/128"]),
    ):
        make_service(
            env,
            agent_ns,
            name,
            on(env, "b1", "b2"),
            type="LoadBalancer",
            extra_spec={"loadBalancerSourceRanges": ranges},
        )
        set_lb_ingress(env, agent_ns, name, [ips[4], ips[6]])
    for proto in PROTOS:
        assert_reaches(env, lb_node[family], 80, proto, BOTH, source=env.n2)
        assert_reaches(env, lb[family], 80, proto, BOTH)  # programmed (client is allowed)
        assert_dropped(env, lb[family], 80, proto, source=env.n2)


def test_load_balancer_source_ranges_of_one_family_close_the_other(
    env: AgentEnv, agent_ns: str
) -> None:
    """Ranges listed for IPv4 only: the IPv6 load-balancer IP is closed to every source (the
    model fails closed: no usable range in a family), not opened; IPv4 admits its range. The
    Service gets a Warning Event LoadBalancerSourceRangesUnusable."""
    lb = lb_ips()
    make_service(
        env,
        agent_ns,
        "fw-v4-only",
        on(env, "b1", "b2"),
        type="LoadBalancer",
        extra_spec={"loadBalancerSourceRanges": [f"{env.client.ipv4}/32"]},
    )
    set_lb_ingress(env, agent_ns, "fw-v4-only", [lb[4], lb[6]])
    for proto in PROTOS:
        assert_reaches(env, lb[4], 80, proto, BOTH)
        assert_dropped(env, lb[6], 80, proto)
    wait_until(
        lambda: (
            ("Warning", "LoadBalancerSourceRangesUnusable")
            in event_reasons(env, agent_ns, "fw-v4-only")
        ),
        30,
        0.5,
        "no LoadBalancerSourceRangesUnusable Event",
    )


def event_reasons(env: AgentEnv, ns: str, name: str) -> set[tuple[str, str]]:
    """(type, reason) of the Events about the Service `ns/name`."""
    events = env.kube.client.get(f"/api/v1/namespaces/{ns}/events")
    return {
        (str(e.get("type")), str(e.get("reason")))
        for e in events.get("items") or []
        if (e.get("involvedObject") or {}).get("name") == name
    }


# ---- 6b. VIP clashes (CVE-2020-8554) -------------------------------------------------------------


def test_an_external_ip_equal_to_a_cluster_ip_does_not_take_it(
    env: AgentEnv, agent_ns: str
) -> None:
    """A Service that names another Service's ClusterIP in its externalIPs (older than the
    victim, and sorting first) does not take the victim's traffic on any node: the ClusterIP
    wins, and the claimant gets a Warning Event VIPClash."""
    vips = static_cluster_ips()
    make_service(
        env,
        agent_ns,
        "a-claimant",
        on(env, "b2"),
        families=(4,),
        ip_family_policy="SingleStack",
        external_ips=[vips[4]],
    )
    for proto in PROTOS:  # the claimant is programmed first, on its own
        assert_reaches(env, vips[4], 80, proto, {"b2"})
    make_service(
        env,
        agent_ns,
        "z-victim",
        on(env, "b1"),
        families=(4,),
        ip_family_policy="SingleStack",
        extra_spec={"clusterIP": vips[4], "clusterIPs": [vips[4]]},
    )
    for proto in PROTOS:
        assert_reaches(env, vips[4], 80, proto, {"b1"})
        assert_reaches(env, vips[4], 80, proto, {"b1"}, source=env.pods["client2"])
    wait_until(
        lambda: ("Warning", "VIPClash") in event_reasons(env, agent_ns, "a-claimant"),
        30,
        0.5,
        "no VIPClash Event",
    )


# ---- 7. dual-stack -------------------------------------------------------------------------------


def test_ipv6_service_traffic_tcp_and_udp(env: AgentEnv, agent_ns: str) -> None:
    dual = make_service(env, agent_ns, "dual", on(env, "b1", "b2"), type="NodePort")
    assert len(dual.obj["spec"]["clusterIPs"]) == 2, dual.obj["spec"]
    v6only = make_service(
        env,
        agent_ns,
        "v6only",
        on(env, "b1", "b2"),
        families=(6,),
        ip_family_policy="SingleStack",
        ip_families=["IPv6"],
    )
    assert [":" in ip for ip in v6only.obj["spec"]["clusterIPs"]] == [True], v6only.obj["spec"]
    for proto in PROTOS:
        assert_reaches(env, dual.ip(6), 80, proto, BOTH)
        assert_reaches(env, dual.ip(4), 80, proto, BOTH)
        assert_reaches(env, v6only.ip(6), 80, proto, BOTH)
        result = assert_reaches(env, env.n1.ipv6, dual.node_port(proto), proto, BOTH)
        # NodePort (externalTrafficPolicy Cluster): masqueraded, to the address n1 leaves from.
        wanted = {"b1": env.n1.gateway_v6, "b2": env.n1.ipv6}
        assert_sources(result, wanted, f"IPv6 NodePort {proto}")


# ---- 8. masquerade -------------------------------------------------------------------------------


@family_param
def test_masquerade_only_off_cluster_sources(env: AgentEnv, agent_ns: str, family: int) -> None:
    remote = make_service(env, agent_ns, "remote", on(env, "b2"))
    local = make_service(env, agent_ns, "local", on(env, "b1"))
    client, n1 = ip_of(env.client, family), ip_of(env.n1, family)
    for proto in PROTOS:
        # A pod (inside the cluster CIDRs) keeps its address.
        result = assert_reaches(env, remote.ip(family), 80, proto, {"b2"})
        assert_sources(result, {client}, f"pod -> ClusterIP -> remote pod ({proto})")
        # The node itself is off-cluster: masqueraded. Towards a remote pod that is n1's
        # fabric address; towards its own pod it is the cbr0 address (the address n1 leaves
        # from), which shows the rewrite happened.
        result = assert_reaches(env, remote.ip(family), 80, proto, {"b2"}, source=env.n1)
        assert_sources(result, {n1}, f"node -> ClusterIP -> remote pod ({proto})")
        result = assert_reaches(env, local.ip(family), 80, proto, {"b1"}, source=env.n1)
        gateway = gateway_of(env.n1, family)
        assert_sources(result, {gateway}, f"node -> ClusterIP -> own pod ({proto})")


@family_param
def test_hairpin_pod_reaches_itself_through_its_service(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    svc = make_service(env, agent_ns, "hairpin", on(env, "b1"))
    b1 = env.pods["b1"]
    for proto in PROTOS:
        result = assert_reaches(env, svc.ip(family), 80, proto, {"b1"}, source=b1)
        # Masqueraded to the node's bridge address: without it b1 would answer itself directly
        # and the connection would never complete.
        assert_sources(result, {gateway_of(env.n1, family)}, f"hairpin {proto}")


# ---- 9. stale UDP conntrack ----------------------------------------------------------------------


def write_slice_now(env: AgentEnv, ns: str, name: str, endpoints: Endpoints, family: int) -> float:
    """Write one family's slice with a single HTTPS request; the wall-clock time just before."""
    (sl,) = slices(ns, name, endpoints, UDP_ONLY, families=(family,))
    t0 = time.time()
    env.kube.apply_now(sl)
    return t0


def first_answer(t0: float) -> Callable[[list[tuple[float, str]]], float | None]:
    failures = ("refused", "timeout", "error")
    return lambda events: next((t for t, w in events if t >= t0 and w not in failures), None)


@family_param
def test_udp_socket_follows_endpoint_removal(env: AgentEnv, agent_ns: str, family: int) -> None:
    svc = make_service(env, agent_ns, "udp", on(env, "b1"), ports=UDP_ONLY)
    vip = svc.ip(family)
    assert_reaches(env, vip, 80, "udp", {"b1"})
    watch = start_udp_socket_watch(env.topology, env.client, vip, 80)
    try:
        t_start = time.time()
        assert watch.wait_for(first_seen("b1", t_start), 5.0), watch.events[-5:]
        # b2 joins: new sockets reach both, the long-lived one stays on b1 (its conntrack
        # entry) - what makes the removal below a test of the agent's conntrack cleanup.
        t_add = write_slice_now(env, agent_ns, "udp", on(env, "b1", "b2"), family)
        assert_reaches(env, vip, 80, "udp", BOTH)
        time.sleep(0.3)
        t_remove = write_slice_now(env, agent_ns, "udp", on(env, "b2"), family)
        seen = watch.wait_for(first_seen("b2", t_remove), UDP_SWITCH_WAIT)
        time.sleep(0.5)
        watch.wait_for(lambda _: None, 0.2)  # read what came meanwhile
    finally:
        watch.stop()
    between = {w for t, w in watch.since(t_add) if t < t_remove}
    assert between == {"b1"}, f"the socket left b1 before b1 was removed: {between}"
    assert seen is not None, (
        f"the UDP socket never reached b2 after b1's removal (stale conntrack entry?): "
        f"{watch.since(t_remove)[:10]}\n{diagnostics(env)}"
    )
    late_b1 = [t - t_remove for t, w in watch.since(seen) if w == "b1"]
    print(f"\nUDP socket on removed b1 -> b2: {(seen - t_remove) * 1000:.0f} ms")
    assert not late_b1, f"b1 answered again after b2 did: {late_b1}"


@family_param
def test_udp_socket_that_sent_before_endpoints_existed_gets_answers(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    """The socket starts sending before the Service exists (its datagrams vanish, leaving a
    conntrack entry without DNAT), keeps sending while the Service has no endpoints, and must
    be answered on the same socket right after endpoints appear."""
    vips = static_cluster_ips()
    watch = start_udp_socket_watch(env.topology, env.client, vips[family], 80)
    try:
        # Datagrams into the void first: a conntrack entry without DNAT, kept alive by the
        # socket's traffic. Without the agent's cleanup the socket stays on it (timeouts) when
        # endpoints appear, while new sockets are answered.
        watch.wait_for(lambda events: events[1][0] if len(events) >= 2 else None, 5.0)
        early = {w for _, w in watch.events}
        assert early == {"timeout"}, f"{vips[family]} answered before its Service existed: {early}"
        extra = {"clusterIP": vips[4], "clusterIPs": [vips[4], vips[6]]}
        make_service(
            env, agent_ns, "late", None, UDP_ONLY, ip_families=["IPv4", "IPv6"], extra_spec=extra
        )
        wait_programmed(env, env.n1, vips[family])
        # New sockets are refused at once: the Service is programmed, without endpoints.
        wait_until(
            lambda: send(env, vips[family], 80, "udp", count=1).refused == 1,
            8.0,
            message=lambda: f"udp {vips[family]} never refused\n{diagnostics(env)}",
        )
        t_add = write_slice_now(env, agent_ns, "late", on(env, "b1", "b2"), family)
        seen = watch.wait_for(first_answer(t_add), UDP_SWITCH_WAIT)
    finally:
        watch.stop()
    before = {w for t, w in watch.events if t < t_add}
    assert before and before <= {"timeout", "refused"}, f"answers before endpoints: {before}"
    assert seen is not None, (
        f"the socket that sent before endpoints existed is never answered: "
        f"{watch.since(t_add)[:10]}\n{diagnostics(env)}"
    )
    print(f"\nUDP socket, 0 -> 2 endpoints: answered after {(seen - t_add) * 1000:.0f} ms")


@family_param
def test_udp_socket_leaves_an_endpoint_removed_while_the_agent_was_down(
    env: AgentEnv, agent_ns: str, family: int
) -> None:
    """A long-lived UDP socket on b1; the agent on n1 stops (its rules stay), b1 leaves the
    Service while no agent runs there (b2 replaces it), the agent starts again. Its first sync
    must move the socket off b1: the entry DNATed to b1, which the socket's own datagrams keep
    alive, goes (conntrack.reconcile_flows), as upstream's cleanup deletes entries whose reply
    comes from no serving endpoint. A change the agent sees (the test above) is not enough
    here: for the new agent b1 never was an endpoint."""
    svc = make_service(env, agent_ns, "udp-down", on(env, "b1"), ports=UDP_ONLY)
    vip = svc.ip(family)
    assert_reaches(env, vip, 80, "udp", {"b1"})
    watch = start_udp_socket_watch(env.topology, env.client, vip, 80)
    try:
        assert watch.wait_for(first_seen("b1", time.time()), 5.0), watch.events[-5:]
        assert env.agent is not None
        assert env.agent.stop() == 0, env.agent.log_tail()
        t_down = write_slice_now(env, agent_ns, "udp-down", on(env, "b2"), family)
        time.sleep(1.0)
        watch.wait_for(lambda _: None, 0.2)  # read what came meanwhile
        t_start = time.time()
        env.start_agent("n1")
        seen = watch.wait_for(first_seen("b2", t_start), UDP_SWITCH_WAIT)
        time.sleep(0.5)
        watch.wait_for(lambda _: None, 0.2)
    finally:
        watch.stop()
    down = {w for t, w in watch.since(t_down) if t < t_start}
    assert down == {"b1"}, f"without an agent the socket did not stay on b1: {down}"
    assert seen is not None, (
        f"the UDP socket stayed on b1, removed while the agent was down: "
        f"{watch.since(t_start)[:10]}\n{diagnostics(env)}"
    )
    late_b1 = [t - t_start for t, w in watch.since(seen) if w == "b1"]
    assert not late_b1, f"b1 answered again after b2 did: {late_b1}"
    print(f"\nUDP socket on b1 (removed while down) -> b2 after the start: {seen - t_start:.1f} s")


# ---- switching modes -----------------------------------------------------------------------------


def spare_node(env: AgentEnv) -> Node:
    """n3: a node without pods or agent (created on first use, for the mode-switch test)."""
    if "n3" not in env.nodes:
        env.nodes["n3"] = env.topology.add_node("n3")
        env.kube.register_node(env.nodes["n3"])
    return env.nodes["n3"]


def leftovers_of(env: AgentEnv, node: Node, mode: str) -> set[str]:
    if mode == "nftables":
        return kpx_tables(env.topology, node)
    return iptables_chains(env.topology, node)


def test_switching_modes_removes_the_previous_modes_rules(env: AgentEnv, agent_ns: str) -> None:
    previous = "iptables" if env.mode == "nftables" else "nftables"
    if previous not in REGISTRY:
        pytest.skip(f"mode {previous} is not registered: no switch from it to test")
    node = spare_node(env)
    topo = env.topology
    svc = make_service(env, agent_ns, "switch", on(env, "b1", "b2"))
    config = write_agent_config(topo.tmpdir / f"agent-{previous}.yaml", previous)
    old = start_agent(topo, node, env.kubeconfig, mode=previous, config=config)
    new: AgentProcess | None = None
    try:
        for proto in PROTOS:
            assert_reaches(env, svc.ip(4), 80, proto, BOTH, source=node)
        assert old.stop() == 0, old.log_tail()
        assert leftovers_of(env, node, previous), f"{previous} left no rules to switch from"

        new = start_agent(topo, node, env.kubeconfig, mode=env.mode, config=env.config)
        left = leftovers_of(env, node, previous)
        assert not left, f"{previous} rules left after switching to {env.mode}: {left}"
        ruleset = topo.exec(node, ["nft", "list", "ruleset"], check=True).stdout
        if previous == "nftables":
            assert "table ip kpx" not in ruleset and "table ip6 kpx" not in ruleset, ruleset
        for family in (4, 6):
            for proto in PROTOS:
                assert_reaches(env, svc.ip(family), 80, proto, BOTH, source=node)
    finally:
        for agent in (old, new):
            if agent is not None:
                agent.kill()
        for mode in MODES:
            run_cleanup(topo, node, mode)
