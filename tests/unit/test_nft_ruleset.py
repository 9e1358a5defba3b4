"""nftables rendering: golden rulesets, element deltas, and no text from unparsed data."""

from __future__ import annotations

import dataclasses
import os
from ipaddress import ip_network
from pathlib import Path

import pytest

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.localnet import (
    IP,
    Endpoint,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ProxySettings,
    ServicePort,
    ServicePortKey,
)

GOLDEN = Path(__file__).parent / "golden"
SETTINGS = ProxySettings(cluster_cidrs=(ip_network("10.244.0.0/16"), ip_network("fd00:244::/48")))
NODE = NodeInfo("n1", addresses=(IP.of("10.242.0.1"), IP.of("fd00:242::1")))


def key(name: str, family: int = 4, proto: Protocol = Protocol.TCP) -> ServicePortKey:
    return ServicePortKey("default", name, "http", proto, family)


def endpoints(*ips: str, local: str = "") -> tuple[Endpoint, ...]:
    return tuple(Endpoint(IP.of(i), 8080, i == local) for i in ips)


def sample_state() -> NodeLocalState:
    eps = endpoints("10.244.1.2", "10.244.2.2", local="10.244.1.2")
    services = [
        ServicePort(key("web"), 80, cluster_ips=(IP.of("10.96.0.10"),),
                    cluster_endpoints=eps, external_endpoints=eps),
        ServicePort(key("dns", proto=Protocol.UDP), 53, cluster_ips=(IP.of("10.96.0.53"),),
                    cluster_endpoints=eps[:1], external_endpoints=eps[:1]),
        ServicePort(key("empty"), 80, cluster_ips=(IP.of("10.96.0.11"),)),
        ServicePort(key("np"), 80, cluster_ips=(IP.of("10.96.0.12"),), node_port=30080,
                    external_ips=(IP.of("192.0.2.10"),),
                    load_balancer_ips=(IP.of("192.0.2.20"),),
                    cluster_endpoints=eps, external_endpoints=eps),
        ServicePort(key("local"), 80, cluster_ips=(IP.of("10.96.0.13"),), node_port=30081,
                    cluster_endpoints=eps, external_endpoints=(),
                    external_masquerade=False, drop_when_no_external_endpoints=True),
        ServicePort(key("web6", family=6), 80, cluster_ips=(IP.of("fd00:96::10"),),
                    cluster_endpoints=endpoints("fd00:244:1::2"),
                    external_endpoints=endpoints("fd00:244:1::2")),
    ]  # fmt: skip
    return NodeLocalState(node=NODE, services={s.key: s for s in services})


def record() -> tuple[NftablesBackend, list[str]]:
    scripts: list[str] = []
    return NftablesBackend(SETTINGS, run_script=scripts.append, our_tables=set), scripts


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KPX_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; review and set KPX_UPDATE_GOLDEN=1"


def test_full_sync_golden() -> None:
    backend, scripts = record()
    backend.sync(sample_state(), None)
    check_golden("full_sync.nft", scripts[-1])


def test_partial_sync_sends_only_the_difference() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=web.cluster_endpoints[:1])
    backend.sync(state, [web.key])
    check_golden("partial_sync.nft", scripts[-1])
    assert "table" not in scripts[-1].replace("add chain ip kpx", "")  # no table swap


def test_removed_service_deletes_its_elements_and_nothing_else() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    before = backend.element_count()
    del state.services[key("dns", proto=Protocol.UDP)]
    backend.sync(state, [key("dns", proto=Protocol.UDP)])
    script = scripts[-1]
    assert script.startswith("delete element") and "add element" not in script
    assert "10.96.0.53" in script and "10.96.0.10" not in script
    assert backend.element_count() == before - 3  # cluster-ips, service-ips, one endpoint


def test_no_change_sends_nothing() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    backend.sync(state, list(state.services))
    assert len(scripts) == 1


def test_failed_transaction_keeps_record_and_forces_full_sync() -> None:
    calls: list[str] = []

    def run(script: str) -> None:
        calls.append(script)
        if len(calls) == 2:
            raise BackendError("kernel said no")

    backend = NftablesBackend(SETTINGS, run_script=run, our_tables=set)
    state = sample_state()
    backend.sync(state, None)
    del state.services[key("web")]
    with pytest.raises(BackendError):
        backend.sync(state, [key("web")])
    backend.sync(state, [])  # the next sync must be a full table swap
    assert calls[-1].startswith("add table ip kpx\ndelete table ip kpx\n")
    assert "10.96.0.10" not in calls[-1]


def test_settings_shape_the_masquerade_rules() -> None:
    backend = NftablesBackend(
        ProxySettings(masquerade_bit=3, masquerade_all=True), run_script=lambda s: None
    )
    state = sample_state()
    backend.sync(state, None)
    script = backend.last_script
    assert "meta mark set meta mark | 0x00000008" in script
    assert "@cluster-ips meta mark set" in script and "!= @cluster-cidrs" not in script


def test_a_new_large_endpoint_count_comes_with_a_full_sync() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    web = state.services[key("web")]
    many = tuple(Endpoint(IP.of(f"10.244.{i // 250}.{i % 250 + 1}"), 8080) for i in range(200))
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=many)
    backend.sync(state, [web.key])
    assert scripts[-1].startswith("add table ip kpx\ndelete table ip kpx\n")
    assert "add chain ip kpx endpoints-200" in scripts[-1]
    # ...after which the chain exists and a change within that count is partial again.
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=many[1:] + many[:1])
    backend.sync(state, [web.key])
    assert scripts[-1].startswith(("delete element", "add element"))


def test_affinity_gets_a_chain_of_its_own_and_changes_touch_only_it() -> None:
    backend, scripts = record()
    state = sample_state()
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, affinity_timeout=60)
    backend.sync(state, None)
    full = scripts[-1]
    assert full.count("flags dynamic,timeout; timeout 60s;") == 2  # one set per endpoint
    assert "10.96.0.10 . tcp . 80 : goto aff-" in full
    assert "numgen random mod 2 == 0 update @aff-" in full
    # Dropping an endpoint rewrites the chain and deletes that endpoint's set, nothing else.
    sticky = state.services[web.key]
    state.services[web.key] = dataclasses.replace(
        sticky, cluster_endpoints=sticky.cluster_endpoints[:1]
    )
    backend.sync(state, [web.key])
    partial = scripts[-1]
    assert "add table" not in partial
    assert partial.count("delete set ip kpx aff-") == 2  # old chain's sets (chain renamed)
    assert "delete chain ip kpx aff-" in partial
    assert partial.index("add chain ip kpx aff-") < partial.index("add element ip kpx service-ips")
    assert partial.index("delete element ip kpx service-ips") < partial.index("delete chain")


def test_load_balancer_source_ranges_are_merged_into_the_firewall_set() -> None:
    backend, scripts = record()
    state = sample_state()
    np = state.services[key("np")]
    state.services[np.key] = dataclasses.replace(
        np,
        load_balancer_source_ranges=(
            ip_network("198.51.100.0/24"),
            ip_network("198.51.100.128/25"),
            ip_network("203.0.113.7/32"),
        ),
    )
    backend.sync(state, None)
    assert "add element ip kpx firewall-ips { 192.0.2.20 . tcp . 80 }" in scripts[-1]
    assert (
        "add element ip kpx firewall-allow { 192.0.2.20 . tcp . 80 . 198.51.100.0/24, "
        "192.0.2.20 . tcp . 80 . 203.0.113.7/32 }"
    ) in scripts[-1]
