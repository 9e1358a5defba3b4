"""Issue "Node agent core and the nftables backend, proven with real packets".

One Topology and one agent on n1 (`agent_env`, module scope) against the session's real
apiserver; each test works in its own namespace (`agent_ns`). Services have no selector: the
tests write the EndpointSlices (there is no kubelet). Every assertion is about packets sent by
the probe from the client pod on n1 (or from n2), answered (or not) by the echo servers b1 (on
n1) and b2 (on n2).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import pytest
from agent_harness import (
    BACKEND_PORT,
    OPT_OUT_LABEL,
    OPT_OUT_VALUE,
    SECOND_PORT,
    SERVICE_PROXY_NAME_LABEL,
    AgentEnv,
    AgentProcess,
    Svc,
    TrafficWatch,
    endpoint_slice,
    first_seen,
    gone_for,
    kpx_tables,
    metric,
    nft_ruleset,
    run_cleanup,
    service,
    service_port,
    wait_until,
    write_agent_config,
)

from kpx_cluster.probe import ProbeResult, format_target

AGENT_MODE = "nftables"
pytestmark = [pytest.mark.e2e, pytest.mark.netns]

BOTH = {"b1", "b2"}
TCP_UDP = [
    service_port("tcp", 80, BACKEND_PORT, "TCP"),
    service_port("udp", 80, BACKEND_PORT, "UDP"),
]
EXTERNAL_IP = "10.250.0.10"
LB_IP = "10.251.0.20"
OPTED_OUT_EXTRA = 40  # Services created in an opted-out namespace to show they are not received
# Seconds to wait for traffic to follow an EndpointSlice write: generous for a busy machine;
# the latency itself is a figure of `make bench` ("one EndpointSlice change -> kernel").
CHANGE_WAIT = 30.0


def slice_ports(ports: Sequence[dict[str, Any]]) -> list[tuple[str, int, str]]:
    return [(str(p["name"]), int(p["targetPort"]), str(p["protocol"])) for p in ports]


def make_service(
    env: AgentEnv,
    ns: str,
    name: str,
    ports: Sequence[dict[str, Any]] = TCP_UDP,
    backends: Sequence[str] | None = ("b1", "b2"),
    families: Sequence[int] = (4,),
    **kwargs: Any,
) -> Svc:
    """A selector-less Service and, unless `backends` is None, one EndpointSlice per family."""
    objs = [service(name, ns, ports, **kwargs)]
    if backends is not None:
        for fam in families:
            objs.append(
                endpoint_slice(
                    f"{name}-v{fam}",
                    ns,
                    name,
                    env.backend_endpoints(fam, backends),
                    slice_ports(ports),
                    address_type=f"IPv{fam}",
                )
            )
    env.kube.apply(*objs)
    return Svc(env.kube.get("service", name, ns))


def diagnostics(env: AgentEnv) -> str:
    agent = env.agent
    tail = agent.log_tail(15) if agent is not None else "(no agent)"
    return f"agent log tail:\n{tail}"


def assert_reaches(
    env: AgentEnv,
    host: str,
    port: int,
    proto: str,
    expected: set[str],
    source: Any = None,
    timeout: float = 5.0,
) -> ProbeResult:
    """Wait until the rules are in place, then: 30 tries, all answered, by exactly the
    `expected` backends."""
    target = f"{proto} {format_target(host, port)}"
    last: list[ProbeResult] = []

    def ok() -> bool:
        r = env.probe(host, port, proto, count=8, timeout=0.5, source=source)
        last[:] = [r]
        return r.backends == expected and r.failed == 0

    wait_until(
        ok,
        timeout,
        interval=0.1,
        message=lambda: (
            f"{target} not answered by {sorted(expected)}: {last[-1]}\n{diagnostics(env)}"
        ),
    )
    if proto == "udp":
        # The tries made before the rules were in place left conntrack entries that were not
        # DNATed; the agent deletes them right after the sync, but off the programming path
        # (conntrack/cleaner.py), so a new try that reuses one of their source ports in the
        # meantime would follow one. Let the cleaner run first (it takes milliseconds).
        time.sleep(0.5)
    result = env.probe(host, port, proto, count=30, timeout=1.0, source=source)
    assert result.failed == 0, f"{target}: {result}"
    assert result.backends == expected, f"{target}: {result}"
    return result


def assert_unanswered(
    env: AgentEnv, host: str, port: int, proto: str = "tcp", timeout: float = 8.0
) -> None:
    """Wait until no backend answers; then check a few more tries get no answer either."""
    target = f"{proto} {format_target(host, port)}"

    def silent() -> bool:
        return env.probe(host, port, proto, count=3, timeout=0.3).answered == 0

    wait_until(silent, timeout, interval=0.1, message=lambda: f"{target} still answered")
    result = env.probe(host, port, proto, count=5, timeout=0.3)
    assert result.answered == 0, f"{target} answered: {result}"


def programmed(env: AgentEnv, ip: str) -> bool:
    return ip in nft_ruleset(env.topology, env.n1)


# ---- 1-5: the ways into a Service ----------------------------------------------------------------


PROTOS = pytest.mark.parametrize("proto", ["tcp", "udp"])


@PROTOS
def test_cluster_ip_reaches_backends_on_both_nodes(
    agent_env: AgentEnv, agent_ns: str, proto: str
) -> None:
    svc = make_service(agent_env, agent_ns, "web")
    assert_reaches(agent_env, svc.ip(), 80, proto, BOTH)


def test_multi_port_service_maps_each_port_to_its_target_port(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    ports = [
        service_port("http", 80, BACKEND_PORT),
        service_port("metrics", 90, SECOND_PORT),
    ]
    objs = [
        service("multi", agent_ns, ports),
        # Slice ports in the other order: they are matched by name, not by position.
        endpoint_slice(
            "multi-v4",
            agent_ns,
            "multi",
            agent_env.backend_endpoints(),
            [("metrics", SECOND_PORT, "TCP"), ("http", BACKEND_PORT, "TCP")],
        ),
    ]
    agent_env.kube.apply(*objs)
    vip = Svc(agent_env.kube.get("service", "multi", agent_ns)).ip()
    assert_reaches(agent_env, vip, 80, "tcp", BOTH)
    assert_reaches(agent_env, vip, 90, "tcp", {f"b1-{SECOND_PORT}", f"b2-{SECOND_PORT}"})


@PROTOS
def test_node_port_on_node_address_from_pod_and_from_other_node(
    agent_env: AgentEnv, agent_ns: str, proto: str
) -> None:
    svc = make_service(agent_env, agent_ns, "np", type="NodePort")
    n1, port = agent_env.n1.ipv4, svc.node_port(proto)
    assert_reaches(agent_env, n1, port, proto, BOTH)
    assert_reaches(agent_env, n1, port, proto, BOTH, source=agent_env.n2)


@PROTOS
def test_external_ip_reaches_backends(agent_env: AgentEnv, agent_ns: str, proto: str) -> None:
    make_service(agent_env, agent_ns, "ext", external_ips=[EXTERNAL_IP])
    assert_reaches(agent_env, EXTERNAL_IP, 80, proto, BOTH)


@PROTOS
def test_load_balancer_ingress_ip_reaches_backends(
    agent_env: AgentEnv, agent_ns: str, proto: str
) -> None:
    make_service(agent_env, agent_ns, "lb", type="LoadBalancer")
    agent_env.kube.patch_status(
        "service", "lb", {"status": {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}}, agent_ns
    )
    assert_reaches(agent_env, LB_IP, 80, proto, BOTH)


@PROTOS
def test_ipv6_cluster_ip_of_dual_stack_service(
    agent_env: AgentEnv, agent_ns: str, proto: str
) -> None:
    svc = make_service(
        agent_env, agent_ns, "dual", families=(4, 6), ip_family_policy="PreferDualStack"
    )
    assert len(svc.obj["spec"]["clusterIPs"]) == 2, svc.obj["spec"]
    assert_reaches(agent_env, svc.ip(6), 80, proto, BOTH)
    assert_reaches(agent_env, svc.ip(4), 80, proto, BOTH)


# ---- 6-7: endpoints ------------------------------------------------------------------------------


def test_endpoint_changes_reach_traffic_without_failed_tries(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    ports = [service_port("http", 80, BACKEND_PORT)]
    svc = make_service(agent_env, agent_ns, "churn", ports, backends=["b1"])
    vip = svc.ip()
    assert_reaches(agent_env, vip, 80, "tcp", {"b1"})

    def write(backends: list[str]) -> float:
        sl = endpoint_slice(
            "churn-v4",
            agent_ns,
            "churn",
            agent_env.backend_endpoints(4, backends),
            slice_ports(ports),
        )
        t0 = time.time()
        agent_env.kube.apply_now(sl)
        return t0

    watch = TrafficWatch.start(agent_env.topology, agent_env.client, vip, 80)
    try:
        t_add = write(["b1", "b2"])
        seen = watch.wait_for(first_seen("b2", t_add), CHANGE_WAIT)
        assert seen is not None, f"b2 never answered after it was added: {diagnostics(agent_env)}"
        added = seen - t_add
        time.sleep(0.2)  # let the agent's minSyncPeriod pass, as any later change would
        t_remove = write(["b2"])
        gone = watch.wait_for(gone_for("b1", t_remove), CHANGE_WAIT)
        assert gone is not None, f"b1 kept answering after removal: {diagnostics(agent_env)}"
        removed = gone - t_remove
    finally:
        watch.stop()
    print(f"\nendpoint added -> in traffic: {added * 1000:.0f} ms")
    print(f"endpoint removed -> out of traffic: {removed * 1000:.0f} ms")
    failures = [e for e in watch.since(t_add) if e[1] not in BOTH]
    assert not failures, f"tries failed while endpoints changed: {failures[:10]}"


def test_service_without_endpoints_refuses_at_once(agent_env: AgentEnv, agent_ns: str) -> None:
    svc = make_service(agent_env, agent_ns, "empty", backends=None)
    vip = svc.ip()
    for proto in ("tcp", "udp"):

        def refused(proto: str = proto) -> bool:
            return agent_env.probe(vip, 80, proto, count=1, timeout=0.5).refused == 1

        wait_until(refused, 8.0, interval=0.1, message=f"{proto} {vip}:80 never refused")
        start = time.monotonic()
        result = agent_env.probe(vip, 80, proto, count=5, timeout=2.0)
        elapsed = time.monotonic() - start
        print(f"\n5 {proto} tries, no endpoints: {elapsed:.2f}s (probe start-up included)")
        # Refused, each at once: a try that waited for an answer would count as a timeout.
        assert result.refused == 5 and result.timeout == 0 and not result.answers, result


# ---- 8-9: Services this agent must leave alone ---------------------------------------------------


def services_received(env: AgentEnv) -> float:
    assert env.agent is not None
    return env.agent.metric("kpx_watch_received_objects_total", resource="services") or 0.0


def test_opted_out_namespace_is_not_proxied_until_the_label_goes(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    kube, agent = agent_env.kube, agent_env.agent
    assert agent is not None
    excluded_before = agent.metric("kpx_opted_out_namespaces") or 0.0
    optout = kube.create_namespace({OPT_OUT_LABEL: OPT_OUT_VALUE}, prefix="optout")
    try:
        wait_until(
            lambda: agent.metric("kpx_opted_out_namespaces") == excluded_before + 1,
            8.0,
            message="kpx_opted_out_namespaces never counted the labelled namespace",
        )
        # The relist that leaves the namespace out follows at once; let the count settle.
        last = [services_received(agent_env)]

        def settled() -> bool:
            now = services_received(agent_env)
            same = now == last[0]
            last[0] = now
            return same

        wait_until(settled, 5.0, interval=0.3, message="watch counters never settled")
        received_before = last[0]
        hidden = make_service(agent_env, optout, "hidden", ports=TCP_UDP[:1])
        many = [service(f"extra{i}", optout, TCP_UDP[:1]) for i in range(OPTED_OUT_EXTRA)]
        kube.apply(*many)
        # A control Service in an ordinary namespace, created afterwards, shows the agent has
        # processed everything up to here.
        control = make_service(agent_env, agent_ns, "control", ports=TCP_UDP[:1])
        assert_reaches(agent_env, control.ip(), 80, "tcp", BOTH)
        assert_unanswered(agent_env, hidden.ip(), 80)
        assert not programmed(agent_env, hidden.ip()), "opted-out Service has rules"
        received = services_received(agent_env) - received_before
        print(
            f"\nService objects received while {OPTED_OUT_EXTRA + 1} were created opted out: "
            f"{received:.0f}"
        )
        # Expected: the control Service, plus deletions from earlier tests' namespaces (at most
        # ~15); a broken exclusion would add all of the opted-out ones.
        assert received < OPTED_OUT_EXTRA / 2, (
            f"the agent received {received:.0f} Service objects for 1 control Service "
            f"while {OPTED_OUT_EXTRA + 1} were created in the opted-out namespace"
        )

        kube.label("namespace", optout, {OPT_OUT_LABEL: None})
        assert_reaches(agent_env, hidden.ip(), 80, "tcp", BOTH)
        assert agent.metric("kpx_opted_out_namespaces") == excluded_before

        kube.label("namespace", optout, {OPT_OUT_LABEL: OPT_OUT_VALUE})
        assert_unanswered(agent_env, hidden.ip(), 80)
        wait_until(
            lambda: not programmed(agent_env, hidden.ip()),
            5.0,
            message="rules of the re-opted-out Service stayed",
        )
        assert agent.alive(), "the agent restarted or died"
    finally:
        kube.delete("namespace", optout)


def test_service_of_another_proxy_is_ignored_until_the_label_goes(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    other = make_service(
        agent_env,
        agent_ns,
        "other",
        ports=TCP_UDP[:1],
        labels={SERVICE_PROXY_NAME_LABEL: "other"},
    )
    control = make_service(agent_env, agent_ns, "control", ports=TCP_UDP[:1])
    assert_reaches(agent_env, control.ip(), 80, "tcp", BOTH)
    assert_unanswered(agent_env, other.ip(), 80)
    assert not programmed(agent_env, other.ip()), "the other proxy's Service has rules"
    agent_env.kube.label("service", "other", {SERVICE_PROXY_NAME_LABEL: None}, agent_ns)
    assert_reaches(agent_env, other.ip(), 80, "tcp", BOTH)


def test_a_slice_labelled_for_another_proxy_is_served_when_its_service_is_not(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    """As upstream kube-proxy v1.36: the service-proxy-name label selects Services only (on
    EndpointSlices only headless is left out), so a slice carrying the label of another proxy
    whose Service does not is proxied: the Service alone decides."""
    svc = make_service(agent_env, agent_ns, "split", ports=TCP_UDP[:1], backends=None)
    sl = endpoint_slice(
        "split-v4",
        agent_ns,
        "split",
        agent_env.backend_endpoints(4, ("b1", "b2")),
        slice_ports(TCP_UDP[:1]),
    )
    sl["metadata"]["labels"][SERVICE_PROXY_NAME_LABEL] = "other"
    agent_env.kube.apply(sl)
    assert_reaches(agent_env, svc.ip(), 80, "tcp", BOTH)


# ---- 13: health and metrics ----------------------------------------------------------------------


def test_healthz_and_sync_metrics(agent_env: AgentEnv, agent_ns: str) -> None:
    agent = agent_env.agent
    assert agent is not None
    status, body = agent.http_get(agent.healthz, "/healthz")
    assert status == 200, body
    assert '"lastUpdated": "2' in body, body
    # As upstream's metrics address (sig-network's "should check kube-proxy urls").
    assert agent.http_get(agent.metrics_address, "/proxyMode") == (200, "nftables")
    text = agent.metrics()
    syncs = metric(text, "kubeproxy_sync_proxy_rules_duration_seconds_count")
    assert syncs is not None and syncs >= 1, "no sync duration observed"
    programmed_before = metric(text, "kubeproxy_network_programming_duration_seconds_count")
    assert programmed_before is not None, "no network programming histogram"

    ports = TCP_UDP[:1]
    now = datetime.datetime.now(datetime.UTC)
    agent_env.kube.apply(
        service("timed", agent_ns, ports),
        endpoint_slice(
            "timed-v4",
            agent_ns,
            "timed",
            agent_env.backend_endpoints(),
            slice_ports(ports),
            trigger_time=now,
        ),
    )
    vip = Svc(agent_env.kube.get("service", "timed", agent_ns)).ip()
    assert_reaches(agent_env, vip, 80, "tcp", BOTH)
    wait_until(
        lambda: (
            (agent.metric("kubeproxy_network_programming_duration_seconds_count") or 0)
            > programmed_before
        ),
        5.0,
        message="kubeproxy_network_programming_duration_seconds did not count the change",
    )
    queued = agent.metric("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds")
    assert queued is not None and queued >= now.timestamp() - 1, queued


SHORT_SYNC_PERIOD = 2.0  # seconds: the health timeout is twice that, as upstream
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"


def health_of(agent: AgentProcess, path: str) -> tuple[int, dict[str, Any]]:
    status, body = agent.http_get(agent.healthz, path)
    return status, (json.loads(body) if status in (200, 503) else {"error": body})


def test_idle_agent_stays_healthy_and_the_deletion_taint_fails_healthz_only(
    agent_env: AgentEnv,
) -> None:
    """syncPeriod 2s (health timeout 4s): an agent with nothing to do stays healthy for six
    syncPeriods, however long ago it last programmed anything (as upstream: only a change
    that waits too long makes it unhealthy). The cluster autoscaler's deletion taint on its
    Node turns /healthz to 503 with nodeEligible false (load balancers drain the node) and
    leaves /livez at 200; without the taint /healthz is 200 again. Both count by code."""
    topo, n2 = agent_env.topology, agent_env.n2
    config = write_agent_config(topo.tmpdir / "sync-2s.yaml", sync_period="2s")
    agent = agent_env.start_agent("n2", config=config)
    try:
        idle_until = time.monotonic() + 6 * SHORT_SYNC_PERIOD
        polls = 0
        while time.monotonic() < idle_until:
            for path in ("/healthz", "/livez"):
                status, body = health_of(agent, path)
                assert status == 200, f"{path} of an idle agent: {status} {body}\n{agent.log()}"
            polls += 1
            time.sleep(0.5)
        assert polls >= 6, f"only {polls} polls in six syncPeriods: the test proves nothing"
        assert body["lastUpdated"] and body["currentTime"], body

        agent_env.kube.kubectl("taint", "node", n2.name, f"{TO_BE_DELETED_TAINT}=1:NoSchedule")
        try:
            wait_until(
                lambda: health_of(agent, "/healthz")[0] == 503,
                5.0,
                interval=0.2,
                message=lambda: f"/healthz not 503 on the tainted node:\n{agent.log_tail()}",
            )
            status, body = health_of(agent, "/healthz")
            assert status == 503 and body["nodeEligible"] is False, body
            assert health_of(agent, "/livez")[0] == 200  # alive: no restart for a drain
        finally:
            agent_env.kube.kubectl("taint", "node", n2.name, f"{TO_BE_DELETED_TAINT}-")
        wait_until(
            lambda: health_of(agent, "/healthz")[0] == 200,
            5.0,
            interval=0.2,
            message="/healthz not 200 once the taint is gone",
        )
        assert health_of(agent, "/healthz")[1]["nodeEligible"] is True
        text = agent.metrics()
        assert (metric(text, "kubeproxy_proxy_healthz_total", code="503") or 0) >= 1, text
        assert (metric(text, "kubeproxy_proxy_healthz_total", code="200") or 0) >= polls
        assert (metric(text, "kubeproxy_proxy_livez_total", code="200") or 0) >= polls + 1
        assert not metric(text, "kubeproxy_proxy_livez_total", code="503")  # 0 (or absent)
    finally:
        assert agent.stop() == 0, agent.log_tail()
        assert run_cleanup(topo, n2).returncode == 0


def test_change_the_kernel_refuses_makes_the_agent_unhealthy_until_programmed(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    """Another process holds a table named like the agent's with the `owner` flag: the
    kernel refuses every change to it from anyone else (EPERM) until its owner goes. A
    Service change then cannot be programmed: /healthz and /livez stay 200 while it is not
    late, turn 503 once it waited the timeout (2 x syncPeriod) while /alivez (the liveness
    probe) stays 200, and are 200 again once the owner is gone and the agent's retry programmed
    it."""
    topo, n2 = agent_env.topology, agent_env.n2
    config = write_agent_config(topo.tmpdir / "sync-2s.yaml", sync_period="2s")
    agent = agent_env.start_agent("n2", config=config)
    holder: subprocess.Popen[str] | None = None
    try:
        holder = topo.run(
            n2,
            ["nft", "-i"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert holder.stdin is not None
        blocked_at = time.monotonic()  # nothing queued can be older than this
        # One transaction: the agent's table is replaced by the held one.
        holder.stdin.write("delete table ip kpx; add table ip kpx { flags owner; }\n")
        holder.stdin.flush()
        wait_until(lambda: "flags owner" in nft_ruleset(topo, n2), 5.0, message="no owned table")
        svc = make_service(agent_env, agent_ns, "refused", TCP_UDP[:1])

        unhealthy_after = None
        while time.monotonic() - blocked_at < 30:
            status, body = health_of(agent, "/healthz")
            if status == 503:
                unhealthy_after = time.monotonic() - blocked_at
                break
            assert status == 200, body
            time.sleep(0.2)
        assert unhealthy_after is not None, f"never unhealthy:\n{agent.log_tail()}"
        assert unhealthy_after >= 2 * SHORT_SYNC_PERIOD, f"503 after {unhealthy_after:.1f}s"
        assert body["nodeEligible"] is True, body  # the proxy's own health, not the node's
        assert health_of(agent, "/livez")[0] == 503
        # The liveness probe's endpoint: a restart would not program it either.
        assert health_of(agent, "/alivez")[0] == 200
        assert "sync failed" in agent.log(), agent.log_tail()

        holder.stdin.close()  # the owner goes, and its table with it
        holder.wait(timeout=5)
        wait_until(
            lambda: health_of(agent, "/healthz")[0] == 200,
            40.0,  # the retry backs off up to 16 s by then
            interval=0.3,
            message=lambda: f"not healthy again:\n{agent.log_tail()}",
        )
        assert health_of(agent, "/livez")[0] == 200
        assert f"{svc.ip()} . tcp . 80" in nft_ruleset(topo, n2)
        text = agent.metrics()
        assert (metric(text, "kubeproxy_proxy_livez_total", code="503") or 0) >= 1, text
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        assert agent.stop() == 0, agent.log_tail()
        assert run_cleanup(topo, n2).returncode == 0


def test_an_element_deleted_behind_the_agents_back_is_restored_within_sync_periods(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    """Someone deletes the Service's element from the agent's dispatch map (its traffic then
    goes nowhere): the agent's periodic check finds its table changed (the ruleset generation
    moved, and the digest of its table differs or cannot be compared) and its full sync puts
    the element back, without any change of the Service."""
    topo, n2 = agent_env.topology, agent_env.n2
    config = write_agent_config(topo.tmpdir / "drift-2s.yaml", sync_period="2s")
    agent = agent_env.start_agent("n2", config=config)
    try:
        svc = make_service(agent_env, agent_ns, "drifted", TCP_UDP[:1])
        element = f"{svc.ip()} . tcp . 80"

        def dispatched() -> bool:
            listing = topo.exec(n2, ["nft", "list", "map", "ip", "kpx", "service-ips"])
            return element in listing.stdout

        wait_until(dispatched, 20.0, message=lambda: f"never programmed:\n{agent.log_tail()}")
        time.sleep(2.5 * SHORT_SYNC_PERIOD)  # a periodic check with the element in place
        topo.exec(n2, ["nft", f"delete element ip kpx service-ips {{ {element} }}"], check=True)
        assert not dispatched()
        wait_until(
            dispatched,
            10 * SHORT_SYNC_PERIOD,
            interval=0.3,
            message=lambda: f"not restored:\n{agent.log_tail()}",
        )
        # Found as drift: its table changed, or (when the agent itself committed since its
        # last check) another writer's commit it cannot tell from a change of its table.
        assert (agent.metric("kpx_forced_full_syncs_total", reason="drift") or 0) >= 1
    finally:
        assert agent.stop() == 0, agent.log_tail()
        assert run_cleanup(topo, n2).returncode == 0


# ---- 10-11: the agent's life cycle ---------------------------------------------------------------


def test_sigkill_keeps_rules_and_new_agent_applies_missed_changes(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    ports = TCP_UDP[:1]
    svc = make_service(agent_env, agent_ns, "survivor", ports)
    vip = svc.ip()
    assert_reaches(agent_env, vip, 80, "tcp", BOTH)
    old = agent_env.agent
    assert old is not None
    old.kill()
    assert not old.alive()

    # While no agent runs, the rules stay in the kernel.
    result = agent_env.probe(vip, 80, "tcp", count=20, timeout=1.0)
    assert result.failed == 0 and result.backends == BOTH, result
    agent_env.kube.apply(
        endpoint_slice(
            "survivor-v4",
            agent_ns,
            "survivor",
            agent_env.backend_endpoints(4, ["b2"]),
            slice_ports(ports),
        )
    )

    watch = TrafficWatch.start(agent_env.topology, agent_env.client, vip, 80)
    try:
        t_start = time.time()
        agent_env.start_agent("n1")
        # The change made while no agent ran is applied.
        gone = watch.wait_for(gone_for("b1", t_start), 10.0)
        assert gone is not None, f"the removed endpoint still answers: {diagnostics(agent_env)}"
    finally:
        watch.stop()
    failures = [e for e in watch.since(t_start) if e[1] not in BOTH]
    assert not failures, f"tries failed while the new agent took over: {failures[:10]}"
    assert_reaches(agent_env, vip, 80, "tcp", {"b2"})


def test_flushed_ruleset_is_rebuilt_at_the_next_sync_period(
    agent_env: AgentEnv, agent_ns: str
) -> None:
    """Someone flushes the node's whole ruleset: at its next syncPeriod the agent finds its
    tables gone (a check-mode probe, cheap at any size) and programs everything again."""
    topo, n2 = agent_env.topology, agent_env.n2
    svc = make_service(agent_env, agent_ns, "reflushed", TCP_UDP[:1])
    config = write_agent_config(topo.tmpdir / "sync-1s.yaml", sync_period="1s")
    agent = agent_env.start_agent("n2", config=config)
    try:
        assert f"{svc.ip()} . tcp . 80" in nft_ruleset(topo, n2)
        topo.exec(n2, ["nft", "flush", "ruleset"], check=True)
        assert kpx_tables(topo, n2) == set()
        wait_until(
            lambda: kpx_tables(topo, n2) == {"ip kpx", "ip6 kpx"},
            5.0,
            message=lambda: f"tables not rebuilt:\n{agent.log_tail(15)}",
        )
        wait_until(
            lambda: f"{svc.ip()} . tcp . 80" in nft_ruleset(topo, n2),
            5.0,
            message=lambda: f"service not reprogrammed:\n{agent.log_tail(15)}",
        )
        # Found by the periodic check, or (when a change arrives first) by the partial sync
        # that fails on the missing table and falls back to a full one.
        log = agent.log_tail(50)
        assert "rules are gone from the kernel" in log or "sync failed" in log, log
    finally:
        assert agent.stop() == 0, agent.log_tail()
        assert run_cleanup(topo, n2).returncode == 0


def test_cleanup_removes_every_kpx_table(agent_env: AgentEnv, agent_ns: str) -> None:
    topo, n2 = agent_env.topology, agent_env.n2
    assert kpx_tables(topo, n2) == set()
    agent = agent_env.start_agent("n2")
    assert kpx_tables(topo, n2) == {"ip kpx", "ip6 kpx"}
    assert agent.stop() == 0, agent.log_tail()
    assert kpx_tables(topo, n2) == {"ip kpx", "ip6 kpx"}, "SIGTERM must leave the rules"

    for _ in range(2):  # idempotent: the second run finds nothing to remove
        res = run_cleanup(topo, n2)
        assert res.returncode == 0, res.stderr
        ruleset = nft_ruleset(topo, n2)
        assert "table ip kpx" not in ruleset and "table ip6 kpx" not in ruleset, ruleset
    # The agent on n1 is not disturbed.
    assert kpx_tables(topo, agent_env.n1) == {"ip kpx", "ip6 kpx"}
