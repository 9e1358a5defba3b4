"""Issue #24: the agent serves every metric upstream kube-proxy v1.36 registers for its mode
(names, types, labels and buckets from upstream's source), and every metric the
kubernetes-mixin Proxy dashboard reads, on the metrics endpoint of agents running against the
real apiserver, one per mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import AgentEnv, AgentProcess, service_port, wait_until, write_agent_config
from prometheus_client.parser import text_string_to_metric_families
from test_agent_nftables import BOTH, assert_reaches, make_service
from upstream_metrics import (
    KUBE_PROXY_JSON,
    dashboard_metrics,
    kube_proxy_metrics,
    parse,
    source_path,
)

from kpx_agent.observability.metrics import AgentMetrics, upstream_names

# The reference checks need no cluster; the running agent needs root and the apiserver.
pytestmark = pytest.mark.e2e

AGENT_MODE = "nftables"
UPSTREAM = kube_proxy_metrics()
MODES = ("nftables", "iptables", "ipvs")


def served(text: str) -> dict[str, tuple[str, set[str], list[float]]]:
    """Name -> (type, label names, histogram buckets) of every metric family with samples;
    counters under their sample name (`_total`)."""
    out: dict[str, tuple[str, set[str], list[float]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.samples:
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        buckets = sorted(
            {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")}
            - {float("inf")}
        )
        out[name] = (family.type, labels, buckets)
    return out


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_reference_file_is_upstreams_source() -> None:
    """The checked-in reference (used where the Go module cache is absent) is the source."""
    path = source_path()
    if not path.exists():
        pytest.skip(f"{path} is not in the Go module cache")
    assert parse(path.read_text()) == json.loads(KUBE_PROXY_JSON.read_text())
    assert len({n for names in UPSTREAM["modes"].values() for n in names}) == 23


@pytest.mark.parametrize("mode", MODES)
def test_the_registry_has_upstreams_metrics_with_their_labels_and_buckets(mode: str) -> None:
    """A unit-level look (the running agents below are the real test): every upstream metric
    of the mode is registered with upstream's type, label names and bucket boundaries."""
    metrics = AgentMetrics(mode)
    assert set(upstream_names(mode)) == set(UPSTREAM["modes"][mode])
    for name in UPSTREAM["modes"][mode]:
        want = UPSTREAM["metrics"][name]
        metric = metrics._upstream.get(name)
        if metric is None:  # the two iptables rule counters (collected at each scrape)
            assert mode == "iptables" and want == {"type": "counter", "labels": []}
            continue
        assert metric._type == want["type"], name  # type: ignore[attr-defined]
        assert list(metric._labelnames) == want["labels"], name  # type: ignore[attr-defined]
        if "buckets" in want:
            bounds = list(metric._upper_bounds[:-1])  # type: ignore[attr-defined]
            assert bounds == pytest.approx(want["buckets"]), name


def assert_serves_upstream(agent: AgentProcess, mode: str, syncs: bool = True) -> None:
    text = agent.metrics()
    have = served(text)
    missing = [n for n in UPSTREAM["modes"][mode] if n not in have]
    assert not missing, f"mode {mode}: not served: {missing}\n{text}"
    for name in UPSTREAM["modes"][mode]:
        want = UPSTREAM["metrics"][name]
        kind, labels, buckets = have[name]
        assert kind == want["type"], (name, kind)
        assert labels == set(want["labels"]), (name, labels)
        if "buckets" in want:
            assert buckets == pytest.approx(want["buckets"]), name
    dashboard, elsewhere = dashboard_metrics()
    absent = dashboard - sample_names(text) - set(elsewhere)
    assert not absent, f"mode {mode}: the Proxy dashboard reads {sorted(absent)}"
    # Fed by real events: the agent's own requests to the apiserver, its syncs.
    assert (agent.metric("rest_client_requests_total", code="200", method="GET") or 0) > 0
    assert (agent.metric("rest_client_request_duration_seconds_count", verb="GET") or 0) > 0
    assert (agent.metric("process_resident_memory_bytes") or 0) > 1e6
    if syncs:
        assert (agent.metric("kubeproxy_sync_proxy_rules_duration_seconds_count") or 0) >= 2
    assert (agent.metric("go_goroutines") or 0) >= 2


@pytest.fixture
def other_agents(agent_env: AgentEnv) -> Iterator[dict[str, AgentProcess]]:
    """Agents in the other modes, each on n2 in turn (nothing else runs there)."""
    started: dict[str, AgentProcess] = {}
    yield started
    for agent in started.values():
        if agent.alive():
            agent.stop(timeout=10)


@pytest.mark.e2e
@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_a_running_agent_serves_every_upstream_and_dashboard_metric(
    agent_env: AgentEnv, agent_ns: str, other_agents: dict[str, AgentProcess], mode: str
) -> None:
    ipvs_here = Path("/proc/net/ip_vs").exists()
    if mode == AGENT_MODE:
        agent = agent_env.agent
        assert agent is not None
    else:
        config = write_agent_config(agent_env.topology.tmpdir / f"agent-{mode}.yaml", mode)
        agent = agent_env.start_agent(
            "n2", mode=mode, config=config, wait=ipvs_here, extra_args=["--logging-format=json"]
        )
        other_agents[mode] = agent
        wait_until(
            lambda: agent.http_get(agent.metrics_address, "/metrics")[0] == 200,
            timeout=30,
            message=agent.log_tail,
        )
    changes = agent.metric("kubeproxy_sync_proxy_rules_service_changes_total") or 0
    slices = agent.metric("kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0
    svc = make_service(agent_env, agent_ns, "m", [service_port("tcp", 80, 8080, "TCP")])
    if mode == AGENT_MODE:
        assert_reaches(agent_env, svc.ip(), 80, "tcp", BOTH)
    wait_until(
        lambda: (agent.metric("kubeproxy_sync_proxy_rules_endpoint_changes_total") or 0) > slices,
        timeout=20,
        message="no EndpointSlice change counted",
    )
    assert (agent.metric("kubeproxy_sync_proxy_rules_service_changes_total") or 0) > changes
    syncs = mode != "ipvs" or ipvs_here
    if not syncs:
        # No IPVS in this kernel (docs/proxy-vm.md runs the ipvs agent where there is): every
        # sync fails, and upstream's ipvs-mode failure counter says so.
        wait_until(
            lambda: (
                (
                    agent.metric(
                        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                        ip_family="IPv4",
                    )
                    or 0
                )
                > 0
            ),
            timeout=20,
            message=agent.log_tail,
        )
    assert_serves_upstream(agent, mode, syncs)
    if mode == "iptables":
        rules = agent.metric("kubeproxy_sync_proxy_rules_iptables_total", table="nat")
        assert rules is not None and rules > 0, agent.metrics()
    if mode != AGENT_MODE:
        assert_json_log(agent, mode, synced=syncs)


def assert_json_log(agent: AgentProcess, mode: str, synced: bool) -> None:
    """--logging-format=json: every line one object with klog's keys; one line per sync with
    the mode, the counts and the duration as keys."""
    records = [json.loads(line) for line in agent.log().splitlines() if line.strip()]
    assert records and all({"ts", "caller", "msg"} <= r.keys() for r in records), records[:3]
    syncs = [r for r in records if "durationSeconds" in r]
    if synced:
        assert syncs, [r["msg"] for r in records]
        for r in syncs:
            assert r["mode"] == mode and r["v"] == 0, r
            assert isinstance(r["changedServicePorts"], int) and r["servicePorts"] >= 1, r
        assert any(r["full"] for r in syncs) and any(not r["full"] for r in syncs), syncs
    else:
        assert any(r.get("level") == "error" and "sync failed" in r["msg"] for r in records)
