"""nftables rendering: golden rulesets, element deltas, and no text from unparsed data."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from ipaddress import ip_network

import pytest
from backend_samples import GOLDEN, SETTINGS, check_golden, key, sample_state

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import NftScripts
from kpx_agent.backends.nftables.ruleset import endpoint_rule
from kpx_agent.backends.nftables.schema import Pair, elements_text
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeLocalState,
    Protocol,
    ServicePortKey,
)

GOLDEN_DIR = GOLDEN


class Recorded(NftablesBackend):
    """The nft text of each sync (its families' transactions, one nft run each, joined),
    and of its netlink element loads (merged)."""

    def __init__(self, present: set[int]) -> None:
        self.scripts: list[str] = []
        self.batches: list[dict[int, dict[str, list[tuple[str, str | None]]]]] = []
        self._runs: list[str] = []
        self._loads: list[dict[int, dict[str, list[Pair]]]] = []
        kernel = NftScripts(present)
        kernel.runs = self._runs
        kernel.load_elements = lambda elements: self._loads.append(  # type: ignore[method-assign]
            {f: {k: list(v) for k, v in s.items()} for f, s in elements.items()}
        )
        super().__init__(SETTINGS, kernel)

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        self._runs.clear()  # the kernel's record, emptied in place
        self._loads.clear()
        try:
            super().sync(state, changed)
        finally:
            if self._runs:
                self.scripts.append("".join(self._runs))
            if self._loads:
                self.batches.append({f: s for load in self._loads for f, s in load.items()})


def record() -> tuple[NftablesBackend, list[str]]:
    backend = Recorded({4, 6})
    return backend, backend.scripts


def test_full_sync_golden() -> None:
    backend, scripts = record()
    backend.sync(sample_state(), None)
    check_golden(GOLDEN_DIR / "full_sync.nft", scripts[-1])


def test_partial_sync_sends_only_the_difference() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=web.cluster_endpoints[:1])
    backend.sync(state, [web.key])
    check_golden(GOLDEN_DIR / "partial_sync.nft", scripts[-1])
    assert "table" not in scripts[-1].replace("add chain ip kpx", "")  # no table swap


def test_one_endpoint_replaced_changes_only_its_kernel_element() -> None:
    """The record keeps a VIP's endpoints as one run (`ruleset.endpoint_run`); a partial sync
    still sends the kernel only the endpoint that changed, at its index."""
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    web = state.services[key("web")]
    first, second = web.cluster_endpoints
    moved = Endpoint("10.244.3.9", second.port, second.local)
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=(first, moved))
    before = backend.element_count()
    backend.sync(state, [web.key])
    assert scripts[-1].splitlines() == [
        "delete element ip kpx endpoints-2 { 10.96.0.10 . tcp . 80 . 1 }",
        "add element ip kpx endpoints-2 { 10.96.0.10 . tcp . 80 . 1 : 10.244.3.9 . 8080 }",
    ]
    assert backend.element_count() == before


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

    def run(parts: Iterable[str]) -> None:
        calls.append("".join(parts))
        if len(calls) == 3:  # the partial sync's (a full sync is one run per family)
            raise BackendError("kernel said no")

    kernel = NftScripts()
    kernel.run = lambda transactions: run(t.render() for t in transactions)  # type: ignore[method-assign]
    backend = NftablesBackend(SETTINGS, kernel)
    state = sample_state()
    backend.sync(state, None)
    del state.services[key("web")]
    with pytest.raises(BackendError):
        backend.sync(state, [key("web")])
    backend.sync(state, [])  # the next sync must be a full table swap
    assert backend.last_script.startswith("add table ip kpx\ndelete table ip kpx\n")
    assert "10.96.0.10" not in backend.last_script


def test_settings_shape_the_masquerade_rules() -> None:
    backend = NftablesBackend(
        DataplaneSettings(masquerade_bit=3, masquerade_all=True), NftScripts()
    )
    state = sample_state()
    backend.sync(state, None)
    script = backend.last_script
    assert "meta mark set meta mark | 0x00000008" in script
    assert "@cluster-ips meta mark set" in script and "!= @local-pod-cidrs" not in script


def test_a_new_endpoint_count_brings_its_chain_and_map_in_a_partial_sync() -> None:
    backend, scripts = record()
    state = sample_state()
    backend.sync(state, None)
    assert "endpoints-200" not in scripts[-1]  # only the counts in use exist
    web = state.services[key("web")]
    many = tuple(Endpoint(IP.of(f"10.244.{i // 250}.{i % 250 + 1}"), 8080) for i in range(200))
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=many)
    backend.sync(state, [web.key])
    lines = scripts[-1].splitlines()
    assert "table" not in scripts[-1].replace("ip kpx", "")  # no table swap
    created = [ln for ln in lines if "endpoints-200" in ln and not ln.startswith("add element")]
    assert created == [
        "add map ip kpx endpoints-200 { typeof ip daddr . meta l4proto . th dport"
        " . numgen random mod 2 : ip daddr . th dport; }",
        "add chain ip kpx endpoints-200",
        "add rule ip kpx endpoints-200 dnat ip to ip daddr . meta l4proto . th dport"
        " . numgen random mod 200 map @endpoints-200"
        f' comment "{endpoint_rule(4, "endpoints-200").comment}"',
    ]
    # The map and chain come before the elements that use them.
    first_element = next(i for i, ln in enumerate(lines) if ln.startswith("add element"))
    assert lines.index("add chain ip kpx endpoints-200") < first_element
    # ...after which they exist: a change within that count only changes elements.
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=many[1:] + many[:1])
    backend.sync(state, [web.key])
    assert all(ln.startswith(("delete element", "add element")) for ln in scripts[-1].splitlines())


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
    # Dropping an endpoint rewrites the chain (renamed) and deletes that endpoint's set; the
    # other endpoint's set, and the clients it holds, stay (upstream's per-endpoint sets).
    sticky = state.services[web.key]
    kept, gone = (
        n.affinity_set(web.key, 60, ep.ip, ep.port) for ep in sticky.cluster_endpoints[:2]
    )
    state.services[web.key] = dataclasses.replace(
        sticky, cluster_endpoints=sticky.cluster_endpoints[:1]
    )
    backend.sync(state, [web.key])
    partial = scripts[-1]
    assert "add table" not in partial
    assert partial.count("delete set ip kpx aff-") == 1
    assert f"delete set ip kpx {gone}\n" in partial
    assert "add set" not in partial and f"ip saddr @{kept} " in partial
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
    lines = {ln.split(" {")[0]: ln for ln in scripts[-1].splitlines() if ln.startswith("add el")}
    assert "192.0.2.20 . tcp . 80" in lines["add element ip kpx firewall-ips"]
    allow = lines["add element ip kpx firewall-allow"]
    assert "192.0.2.20 . tcp . 80 . 198.51.100.0/24" in allow
    assert "192.0.2.20 . tcp . 80 . 203.0.113.7/32" in allow
    assert "198.51.100.128/25" not in allow  # merged into the /24


def test_a_vip_claimed_twice_still_gets_every_map_its_elements_use() -> None:
    """Two Services on one load-balancer IP and port with different endpoint counts: the
    first claim dispatches; the second's endpoint elements still go into their count's map,
    which must exist before them, in a full sync and in a partial one."""
    backend, scripts = record()
    state = sample_state()
    lb = IP.of("192.0.2.50")
    eps3 = tuple(Endpoint(IP.of(f"10.244.3.{i}"), 8080) for i in range(1, 4))
    eps5 = tuple(Endpoint(IP.of(f"10.244.5.{i}"), 8080) for i in range(1, 6))
    first = dataclasses.replace(
        state.services[key("web")],
        load_balancer_ips=(lb,),
        cluster_ips=(IP.of("10.96.0.60"),),
        cluster_endpoints=eps3,
        external_endpoints=eps3,
        key=key("lb-a"),
    )
    second = dataclasses.replace(
        first,
        key=key("lb-b"),
        cluster_ips=(IP.of("10.96.0.61"),),
        cluster_endpoints=eps5[:4],
        external_endpoints=eps5,
    )
    state.services[first.key], state.services[second.key] = first, second
    backend.sync(state, None)

    def maps_before_elements(script: str, existing: set[str]) -> None:
        lines = script.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("add element ip kpx endpoints-"):
                name = line.split()[4]
                created = f"add map ip kpx {name} {{"
                assert any(ln.startswith(created) for ln in lines[:i]) or name in existing, line

    maps_before_elements(scripts[-1], set())
    assert "add element ip kpx endpoints-5 {" in scripts[-1]  # the second claim's, unused
    existing = {"endpoints-1", "endpoints-2", "endpoints-3", "endpoints-4", "endpoints-5"}
    third = dataclasses.replace(second, external_endpoints=eps5 + eps3)  # 8: a new count
    state.services[third.key] = third
    backend.sync(state, [third.key])
    assert "add map ip kpx endpoints-8 {" in scripts[-1]
    maps_before_elements(scripts[-1], existing)


def record_cold(
    present: set[int],
) -> tuple[NftablesBackend, list[str], list[dict[int, dict[str, list[tuple[str, str | None]]]]]]:
    """A backend that finds only the `present` families' tables in the kernel."""
    backend = Recorded(present)
    return backend, backend.scripts, backend.batches


def batch_text(batch: dict[int, dict[str, list[Pair]]]) -> str:
    out = []
    for fam, sets in sorted(batch.items()):
        for set_name, pairs in sorted(sets.items()):
            body = elements_text(pairs)
            out.append(
                f"netlink add element {'ip' if fam == 4 else 'ip6'} kpx {set_name} {{ {body} }}"
            )
    return "\n".join(out) + "\n"


def test_cold_full_sync_golden() -> None:
    """No table in the kernel: nft creates the tables, their chains and maps (and the interval
    sets' elements); every other element goes by netlink after it."""
    backend, scripts, batches = record_cold(set())
    backend.sync(sample_state(), None)
    check_golden(
        GOLDEN_DIR / "full_sync_cold.txt", scripts[-1] + "# then\n" + batch_text(batches[-1])
    )
    assert len(scripts) == len(batches) == 1  # one sync
    # An interval set: its elements (ranges) stay in the nft transaction.
    assert "add element ip kpx firewall-allow {" in scripts[-1]
    assert "firewall-allow" not in batches[-1][4]
    assert "add element ip kpx service-ips" not in scripts[-1]
    assert "add map ip kpx endpoints-2" in scripts[-1]  # the map exists before its elements


def test_cold_and_warm_full_syncs_program_the_same_elements() -> None:
    warm, warm_scripts = record()
    warm.sync(sample_state(), None)
    cold, cold_scripts, batches = record_cold(set())
    cold.sync(sample_state(), None)

    def elements(script: str) -> set[tuple[str, str]]:
        out = set()
        for line in script.splitlines():
            if line.startswith(("add element", "netlink add element")):
                head, _, body = line.partition(" { ")
                set_ref = " ".join(head.split()[-3:])
                out |= {(set_ref, e) for e in body.removesuffix(" }").split(", ")}
        return out

    cold_all = elements(cold_scripts[-1]) | elements(batch_text(batches[-1]))
    assert cold_all == elements(warm_scripts[-1])
    assert cold.element_count() == warm.element_count()


def test_only_the_family_without_a_table_is_loaded_by_netlink() -> None:
    """A table still in the kernel is swapped in one nft transaction, elements included, so
    its old rules serve until the new ones are complete."""
    backend, scripts, batches = record_cold({4})
    backend.sync(sample_state(), None)
    assert list(batches[-1]) == [6]
    assert "add element ip kpx service-ips" in scripts[-1]
    assert "add element ip6 kpx service-ips" not in scripts[-1]


def test_failed_element_batch_forces_another_full_sync() -> None:
    calls: list[str] = []
    loads: list[object] = []
    present: set[int] = set()

    def refuse_once(elements: object) -> None:
        loads.append(elements)
        if len(loads) == 1:
            present.update({4, 6})  # nft created the tables, empty
            raise BackendError("kernel said no")

    kernel = NftScripts()
    kernel.runs = calls
    kernel.present_families = lambda: set(present)  # type: ignore[method-assign]
    kernel.load_elements = refuse_once  # type: ignore[method-assign]
    backend = NftablesBackend(SETTINGS, kernel)
    state = sample_state()
    with pytest.raises(BackendError, match="IPv4: kernel said no"):
        backend.sync(state, None)  # IPv4's load refused; IPv6 went on
    assert not backend.programmed() and backend.element_count() == 3  # IPv6's
    backend.sync(state, [key("web")])  # a partial sync is not enough: a full swap, in nft
    assert backend.last_script.startswith("add table ip kpx\ndelete table ip kpx\n")
    assert "add element ip kpx service-ips" in backend.last_script
    assert backend.programmed() and backend.element_count() > 3
