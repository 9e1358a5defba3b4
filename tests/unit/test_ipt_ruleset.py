"""iptables rendering: golden restore scripts, chain-level deltas, full-sync takeover, cleanup,
and no text from unparsed data."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from ipaddress import ip_network
from pathlib import Path

import pytest
from backend_samples import GOLDEN, NODE, SETTINGS, check_golden, endpoints, key, sample_state

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.iptables import create, script
from kpx_agent.backends.iptables import kernel as ipt_kernel
from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables.backend import IptablesBackend, cleanup
from kpx_agent.backends.iptables.fake import FakeIptables, IptScripts
from kpx_agent.backends.iptables.rule import Rule, Verdict
from kpx_agent.backends.iptables.rules import port_rules, probability
from kpx_agent.model.detect_local import local_pods
from kpx_agent.model.service_ports import local_state, service_ports
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)

GOLDEN_DIR = GOLDEN / "iptables"
LOCAL = local_pods(SETTINGS, NODE, 4)  # the sample's IPv4 detectLocal match (ClusterCIDR)


def texts(rules: tuple[Rule, ...]) -> tuple[str, ...]:
    return tuple(r.text for r in rules)


class Kernel(IptScripts):
    """A recording stand-in for the iptables tools: saved output per (family, table)."""

    def __init__(self, saved: dict[tuple[int, str], str] | None = None) -> None:
        super().__init__(saved)
        self.fail_on: set[int] = set()  # 1-based restore calls that fail
        self.sysctls: list[tuple[Path, int]] = []  # (file, value) the backend ensured

    def restore(self, family: int, script: str) -> None:
        super().restore(family, script)
        if len(self.scripts) in self.fail_on:
            raise BackendError("iptables-restore: line 3 failed")

    def backend(
        self, settings: DataplaneSettings = SETTINGS, route_localnet: Path | None = None
    ) -> IptablesBackend:
        return IptablesBackend(
            settings,
            self,
            ensure_sysctl=lambda path, value: self.sysctls.append((path, value)),
            **({"route_localnet_file": route_localnet} if route_localnet else {}),
        )


def synced(
    settings: DataplaneSettings = SETTINGS,
) -> tuple[IptablesBackend, Kernel, NodeLocalState]:
    kernel = Kernel()
    backend = kernel.backend(settings)
    state = sample_state(settings)
    backend.sync(state, None)
    return backend, kernel, state


def family_script(scripts: list[tuple[int, str]], family: int) -> str:
    return "".join(s for f, s in scripts if f == family)


def declared(script: str) -> set[str]:
    return set(re.findall(r"^:(\S+) - \[0:0\]$", script, re.M))


def test_full_sync_golden() -> None:
    _, kernel, _ = synced()
    assert [(f, s.split("\n", 1)[0]) for f, s in kernel.scripts] == [
        (4, "*nat"),
        (4, "*filter"),
        (6, "*nat"),
        (6, "*filter"),
    ]
    check_golden(GOLDEN_DIR / "full_sync.v4.rules", family_script(kernel.scripts, 4))
    check_golden(GOLDEN_DIR / "full_sync.v6.rules", family_script(kernel.scripts, 6))


def test_partial_sync_sends_only_the_changed_chains() -> None:
    backend, kernel, state = synced()
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=web.cluster_endpoints[:1])
    kernel.scripts.clear()
    backend.sync(state, [web.key])
    assert [f for f, _ in kernel.scripts] == [4]  # IPv4 nat only
    script = kernel.scripts[0][1]
    check_golden(GOLDEN_DIR / "partial_sync.v4.rules", script)
    assert declared(script) == {n.svc_chain(web.key)}, "KPX-SERVICES did not change"
    assert "10.244.2.2" not in script and "-I " not in script and "-D " not in script


def test_a_new_service_rewrites_the_dispatch_chain_and_adds_its_own() -> None:
    backend, kernel, state = synced()
    eps = endpoints("10.244.2.7")
    late = ServicePort(
        key("late"),
        8080,
        cluster_ips=(IP.of("10.96.0.99"),),
        cluster_endpoints=eps,
        external_endpoints=eps,
    )
    state.services[late.key] = late
    kernel.scripts.clear()
    backend.sync(state, [late.key])
    ((fam, script),) = kernel.scripts
    assert fam == 4
    assert declared(script) == {n.SERVICES, n.svc_chain(late.key)}
    # The whole dispatch chain is rewritten: every other service's entry is still in it.
    assert script.count(f"-A {n.SERVICES} ") == 12
    assert "-d 10.96.0.99/32 -p tcp -m tcp --dport 8080" in script


def test_removed_service_deletes_its_chains_and_nothing_else() -> None:
    backend, kernel, state = synced()
    dns = key("dns", proto=Protocol.UDP)
    owned = {c for t, c in port_rules(state.services[dns], SETTINGS, LOCAL).own}
    chains_before = backend.chain_count()
    del state.services[dns]
    kernel.scripts.clear()
    backend.sync(state, [dns])
    ((_, script),) = kernel.scripts
    assert declared(script) == owned | {n.SERVICES}
    assert {line[3:] for line in script.splitlines() if line.startswith("-X ")} == owned
    assert "10.96.0.53" not in script and "10.96.0.10" in script
    assert backend.chain_count() == chains_before - len(owned) == chains_before - 1


def test_no_change_sends_nothing() -> None:
    backend, kernel, state = synced()
    backend.sync(state, list(state.services))
    assert len(kernel.scripts) == 4


def test_failed_restore_reverts_its_family_and_forces_a_full_sync() -> None:
    """A partial sync whose IPv4 nat restore fails (after IPv4 filter): the IPv4 filter table
    it had changed is put back as it was; IPv6's change still goes in; the next sync is full."""
    backend, kernel, state = synced()
    web, web6 = state.services[key("web")], state.services[key("web6", family=6)]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=(), external_endpoints=())
    del state.services[web6.key]
    kernel.fail_on = {6}  # the full sync's 4 runs, then IPv4 filter (5), IPv4 nat (6)
    with pytest.raises(BackendError, match="IPv4"):
        backend.sync(state, [web.key, web6.key])
    runs = [(f, s.splitlines()[0]) for f, s in kernel.scripts[4:]]
    assert runs == [(4, "*filter"), (4, "*nat"), (4, "*filter"), (6, "*nat")]
    rejected = "-d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j REJECT"
    assert rejected in kernel.scripts[4][1] and rejected not in kernel.scripts[6][1]  # undone
    assert "-X " + n.svc_chain(web6.key) in kernel.scripts[7][1]  # IPv6's change went in
    assert not backend.programmed()
    kernel.fail_on = set()
    kernel.scripts.clear()
    backend.sync(state, [])  # the next sync must be a full one
    assert len(kernel.scripts) == 4
    assert ":KPX-MARK-MASQ - [0:0]" in kernel.scripts[0][1]
    assert "fd00:96::10" not in kernel.scripts[2][1]


def test_failed_full_sync_keeps_forcing_full_syncs() -> None:
    kernel = Kernel()
    kernel.fail_on = {2}
    backend = kernel.backend()
    state = sample_state()
    with pytest.raises(BackendError):
        backend.sync(state, None)
    kernel.scripts.clear()
    kernel.fail_on = set()
    backend.sync(state, [key("web")])
    assert len(kernel.scripts) == 4


def test_settings_shape_the_masquerade_rules() -> None:
    _, kernel, _ = synced(DataplaneSettings(masquerade_bit=3, masquerade_all=True))
    script = family_script(kernel.scripts, 4)
    svc = n.svc_chain(key("web"))
    assert f"-A {n.MARK_MASQ} -j MARK --or-mark 0x8\n" in script
    assert f"-A {n.POSTROUTING} -m mark ! --mark 0x8/0x8 -j RETURN\n" in script
    # masqueradeAll: traffic to the cluster IP (not what the short circuit sends here).
    assert f"-A {svc} -d 10.96.0.10/32 -j {n.MARK_MASQ}\n" in script and "! -s" not in script

    _, kernel, _ = synced(DataplaneSettings())  # no cluster CIDRs: only hairpin and external
    script = family_script(kernel.scripts, 4)
    assert f"-A {svc} -m statistic" in script and "! -s" not in script

    two = DataplaneSettings(
        cluster_cidrs=(ip_network("10.244.0.0/16"), ip_network("10.245.0.0/16"))
    )
    _, kernel, _ = synced(two)
    script = family_script(kernel.scripts, 4)
    assert f"-A {svc} -j {n.OFF_CLUSTER}\n" in script
    assert (
        f"-A {n.OFF_CLUSTER} -s 10.245.0.0/16 -j RETURN\n-A {n.OFF_CLUSTER} -j {n.MARK_MASQ}\n"
        in script
    )
    assert n.OFF_CLUSTER not in family_script(kernel.scripts, 6)


def test_full_sync_renders_new_settings_and_node_facts() -> None:
    """The proxier asks for a full sync when settings or node facts change (see
    test_proxier); the full sync renders them."""
    backend, kernel, state = synced()
    kernel.scripts.clear()
    backend.settings = dataclasses.replace(SETTINGS, masquerade_bit=5)
    backend.sync(state, None)
    assert len(kernel.scripts) == 4 and "--or-mark 0x20" in kernel.scripts[0][1]
    kernel.scripts.clear()
    state = sample_state(backend.settings, NodeInfo("n1", addresses=(IP.of("10.242.0.9"),)))
    backend.sync(state, None)
    assert len(kernel.scripts) == 4
    assert (
        f"-A {n.SERVICES} -d 10.242.0.9/32 -m addrtype --dst-type LOCAL -j {n.NODEPORTS}"
        in kernel.scripts[0][1]
    )
    # No IPv6 address on the node: no IPv6 NodePorts (upstream's "primary" addresses).
    assert f"-j {n.NODEPORTS}" not in kernel.scripts[2][1]
    # No address known at all (Node not seen yet): any local address but localhost.
    kernel.scripts.clear()
    backend.sync(sample_state(backend.settings, NodeInfo("n1")), None)
    assert f"! -d ::1/128 -m addrtype --dst-type LOCAL -j {n.NODEPORTS}" in kernel.scripts[2][1]


def test_nodeport_networks_restrict_nodeports_to_local_addresses_in_them() -> None:
    settings = dataclasses.replace(SETTINGS, node_port_networks=(ip_network("10.242.0.0/24"),))
    _, kernel, _ = synced(settings)
    nat4, filter4, nat6, _ = (s for _, s in kernel.scripts)
    match = "-d 10.242.0.0/24 -m addrtype --dst-type LOCAL"
    assert f"{match} -j {n.NODEPORTS}\n" in nat4
    assert f"{match} -j {n.NODEPORTS_REJECT}\n" in filter4
    assert f"-j {n.NODEPORTS}\n" not in nat6  # no network of that family: no NodePorts


def test_affinity_uses_recent_lists_per_endpoint() -> None:
    sticky = sample_state().services[key("sticky")]
    svc = port_rules(sticky, SETTINGS, LOCAL).own[("nat", n.svc_chain(sticky.key))]
    lists = [n.affinity_list(sticky.key, ep) for ep in sticky.cluster_endpoints]
    dnat = "-j DNAT --to-destination 10.244"
    assert texts(svc[1:]) == (
        f"-p tcp -m recent --name {lists[0]} --update --seconds 10800 --reap {dnat}.1.2:8080",
        f"-p tcp -m recent --name {lists[1]} --update --seconds 10800 --reap {dnat}.2.2:8080",
        "-m statistic --mode random --probability 0.5000000000 "
        f"-p tcp -m recent --name {lists[0]} --set {dnat}.1.2:8080",
        f"-p tcp -m recent --name {lists[1]} --set {dnat}.2.2:8080",
    )


def test_hairpin_masquerades_local_endpoints_reaching_themselves() -> None:
    _, kernel, _ = synced()
    script = kernel.scripts[0][1]
    assert f"-A {n.POSTROUTING} -m conntrack --ctstate DNAT -j {n.HAIRPIN}\n" in script
    rule = f"-A {n.HAIRPIN} -s 10.244.1.2/32 -d 10.244.1.2/32 -j {n.MARK_MASQ}\n"
    assert script.count(rule) == 1  # wanted by six service ports, written once
    assert f"-A {n.HAIRPIN} -s 10.244.2.2/32" not in script  # not a local endpoint


def test_probability_cascade_is_uniform() -> None:
    assert [probability(i, 4) for i in range(3)] == ["0.2500000000", "0.3333333333", "0.5000000000"]


def test_local_external_policy_never_meets_the_off_cluster_masquerade() -> None:
    eps = endpoints("10.244.1.2", local="10.244.1.2")
    sp = ServicePort(
        key("etpl"),
        80,
        cluster_ips=(IP.of("10.96.0.16"),),
        node_port=30082,
        cluster_endpoints=eps,
        external_endpoints=eps,
        external_masquerade=False,
    )
    rules = port_rules(sp, SETTINGS, LOCAL)
    ext = rules.own[("nat", n.ext_chain(sp.key))]
    assert texts(ext) == ("-p tcp -j DNAT --to-destination 10.244.1.2:8080",)
    cluster_masq = dataclasses.replace(sp, external_masquerade=True)
    ext = port_rules(cluster_masq, SETTINGS, LOCAL).own[("nat", n.ext_chain(sp.key))]
    assert texts(ext) == (f"-j {n.MARK_MASQ}", f"-j {n.svc_chain(sp.key)}")


def test_load_balancer_source_ranges() -> None:
    fw = sample_state().services[key("fw")]
    rules = port_rules(fw, SETTINGS, LOCAL)
    chain, ext = n.fw_chain(fw.key), n.ext_chain(fw.key)
    assert texts(rules.own[("nat", chain)]) == (f"-s 198.51.100.0/24 -j {ext}",)
    assert (
        f"-d 192.0.2.30/32 -p tcp -m tcp --dport 443 -j {chain}"
        in rules.shared[("nat", n.SERVICES)][1].text
    )
    assert [r.text.split(" -d ")[1] for r in rules.shared[("filter", n.FIREWALL)]] == [
        "192.0.2.30/32 -p tcp -m tcp --dport 443 -j RETURN",
        "192.0.2.30/32 -p tcp -m tcp --dport 443 -j DROP",
    ]


def test_full_sync_takes_over_existing_rules_without_duplicates() -> None:
    nat = "\n".join(
        [
            "*nat",
            ":PREROUTING ACCEPT [0:0]",
            ":INPUT ACCEPT [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            ":POSTROUTING ACCEPT [0:0]",
            ":FOREIGN - [0:0]",
            ":KPX-SERVICES - [0:0]",
            ":KPX-SVC-STALESTALESTALE - [0:0]",
            "-A PREROUTING -m comment --comment kpx -j KPX-SERVICES",
            "-A PREROUTING -m comment --comment kpx -j KPX-SERVICES",
            '-A PREROUTING -m comment --comment "kpx older" -j FOREIGN',
            "-A OUTPUT -j FOREIGN",
            "-A OUTPUT -m comment --comment kpx -j KPX-SVC-STALESTALESTALE",
            "-A FOREIGN -m comment --comment kpx -j RETURN",
            "COMMIT",
            "",
        ]
    )
    kernel = Kernel({(4, "nat"): nat})
    kernel.backend().sync(sample_state(), None)
    script = kernel.scripts[0][1]
    assert script.count("-D PREROUTING -m comment --comment kpx -j KPX-SERVICES\n") == 1
    assert "-I PREROUTING" not in script  # one was there already
    assert "-D OUTPUT -m comment --comment kpx -j KPX-SVC-STALESTALESTALE\n" in script
    assert "-I OUTPUT 1 -m comment --comment kpx -j KPX-SERVICES\n" in script
    assert "-I POSTROUTING 1 -m comment --comment kpx -j KPX-POSTROUTING\n" in script
    assert script.rstrip().endswith("-X KPX-SVC-STALESTALESTALE\nCOMMIT")
    assert "FOREIGN" not in script and "older" not in script
    # Lines run in order: the jump edits and the chains they name first, every chain
    # declared (flushed) before a line names it, deletions last.
    lines = script.splitlines()
    first_rule = next(i for i, line in enumerate(lines) if line.startswith("-A "))
    assert max(i for i, line in enumerate(lines) if line.startswith(("-D", "-I"))) < first_rule
    assert_declared_before_use(script)
    first_delete = next(i for i, line in enumerate(lines) if line.startswith("-X "))
    assert all(line.startswith("-X ") for line in lines[first_delete:-1])


def assert_declared_before_use(text: str) -> None:
    """Each of our chains is declared (created or flushed) before any line names it, as
    its rules' chain or their jump's target: legacy iptables-restore resolves a target as it
    reads the line, and the streamed full sync declares each port's chains with its rules."""
    declared: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("*"):
            declared = set()
        elif line.startswith(":"):
            declared.add(line[1:].split()[0])
        elif line.startswith(("-A ", "-I ")):
            words = line.split()
            named = [words[1], *(words[i + 1] for i, w in enumerate(words[:-1]) if w == "-j")]
            for chain in named:
                assert not n.is_ours(chain) or chain in declared, (number, line)


def test_cleanup_removes_exactly_ours() -> None:
    filt = "\n".join(
        [
            "# Generated by iptables-save",
            "*filter",
            ":INPUT ACCEPT [0:0]",
            ":FORWARD DROP [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            ":KPX-FILTER - [0:0]",
            ":KPX-REJECT - [0:0]",
            ":DOCKER - [0:0]",
            "-A INPUT -m conntrack --ctstate NEW -m comment --comment kpx -j KPX-FILTER",
            "-A FORWARD -j DOCKER",
            "-A KPX-FILTER -j KPX-REJECT",
            "COMMIT",
        ]
    )
    kernel = Kernel({(6, "filter"): filt})
    cleanup(kernel)
    assert kernel.scripts == [
        (
            6,
            "*filter\n:KPX-FILTER - [0:0]\n:KPX-REJECT - [0:0]\n"
            "-D INPUT -m conntrack --ctstate NEW -m comment --comment kpx -j KPX-FILTER\n"
            "-X KPX-FILTER\n-X KPX-REJECT\nCOMMIT\n",
        )
    ]
    kernel.scripts.clear()
    backend = kernel.backend()
    backend.cleanup()  # the backend's own cleanup is the same, and forgets its record
    assert len(kernel.scripts) == 1 and not backend.programmed()


def test_names_are_stable_and_fit() -> None:
    k = key("a-very-long-service-name-that-goes-on-and-on-and-on", family=6)
    ep = Endpoint(IP.of("fd00:244:1::2"), 8080)
    for name in (n.svc_chain(k), n.ext_chain(k), n.fw_chain(k), n.affinity_list(k, ep)):
        assert len(name) <= n.MAX_CHAIN_NAME and re.fullmatch(r"KPX-[A-Z]+-[A-Z2-7]{16}", name)
    assert n.svc_chain(k) == n.svc_chain(dataclasses.replace(k))
    assert n.svc_chain(k) != n.svc_chain(dataclasses.replace(k, family=4))
    assert max(len(c) for _, _, _, c in n.JUMPS) <= n.MAX_CHAIN_NAME


def test_unsafe_names_are_not_pasted() -> None:
    bad = ServicePortKey('x" -j ACCEPT\n-A INPUT', "svc", "p", Protocol.TCP, 4)
    eps = endpoints("10.244.1.2")
    sp = ServicePort(
        bad, 80, cluster_ips=(IP.of("10.96.0.20"),), cluster_endpoints=eps, external_endpoints=eps
    )
    rules = port_rules(sp, SETTINGS, LOCAL)
    text = "\n".join(
        r.text for chain in (*rules.own.values(), *rules.shared.values()) for r in chain
    )
    assert "ACCEPT" not in text and "INPUT" not in text and "comment" not in text
    # Values of the wrong family or out of range never reach a backend: the model leaves
    # them out (see also test_node_local.test_invalid_ports_and_protocols_are_skipped); a
    # backend renders what it is given, without checking again.
    svc = {
        "metadata": {"namespace": "x", "name": "svc"},
        "spec": {
            "clusterIPs": ["10.96.0.20", "fd00::1"],
            "ipFamilies": ["IPv4"],
            "ports": [{"name": "p", "port": 80}, {"name": "q", "port": 70000}],
        },
    }
    eps_slice = {
        "addressType": "IPv4",
        "ports": [{"name": "p", "port": 70000}],
        "endpoints": [{"addresses": ["10.244.1.3"]}],
    }
    ports = service_ports(svc, [eps_slice], NODE)
    assert sorted(
        (p.key.port_name, p.family, p.cluster_ips, p.cluster_endpoints) for p in ports
    ) == [
        ("p", 4, (IP.of("10.96.0.20"),), ()),
        ("p", 6, (IP.of("fd00::1"),), ()),
    ]


def test_create_gives_an_iptables_backend() -> None:
    backend = create(SETTINGS)
    assert backend.mode == "iptables" and backend.settings is SETTINGS
    assert backend.element_count() == 0


def test_short_circuit_with_both_policies_local_has_a_chain_of_its_own() -> None:
    """internalTrafficPolicy and externalTrafficPolicy Local, no local endpoint: cluster IPs
    drop, external traffic drops, and local pods and the node itself are sent to every
    cluster endpoint by a KPX-SHORT chain (the SVC chain would hold local endpoints only)."""
    remote = endpoints("10.244.2.2")
    sp = ServicePort(
        key("both"),
        80,
        cluster_ips=(IP.of("10.96.0.40"),),
        node_port=30090,
        load_balancer_ips=(IP.of("192.0.2.40"),),
        short_circuit_endpoints=remote,
        external_masquerade=False,
        drop_when_no_cluster_endpoints=True,
        drop_when_no_external_endpoints=True,
    )
    rules = port_rules(sp, SETTINGS, LOCAL)
    short, ext = n.short_chain(sp.key), n.ext_chain(sp.key)
    assert set(rules.own) == {("nat", short), ("nat", ext)}
    assert texts(rules.own[("nat", short)]) == ("-p tcp -j DNAT --to-destination 10.244.2.2:8080",)
    assert texts(rules.own[("nat", ext)]) == (
        f"-s 10.244.0.0/16 -j {short}",
        f"-m addrtype --src-type LOCAL -j {n.MARK_MASQ}",
        f"-m addrtype --src-type LOCAL -j {short}",
    )
    assert len(short) <= n.MAX_CHAIN_NAME
    reject = rules.shared[("filter", n.REJECT)]
    assert [r.target for r in reject] == [Verdict.DROP, Verdict.DROP]  # cluster IP, LB IP
    assert rules.shared[("filter", n.NODEPORTS_REJECT)][0].text.endswith("--dport 30090 -j DROP")
    assert rules.shared[("nat", n.NODEPORTS)][0].text.endswith(f"--dport 30090 -j {ext}")


# ---- route_localnet (localhost NodePorts) --------------------------------------------------------


@pytest.mark.parametrize(
    ("localhost", "route_localnet", "expected"),
    [
        (True, None, [(ipt_kernel.ROUTE_LOCALNET_FILE, 1)]),
        # In a pod: the node's file, mounted where the operator says (--route-localnet-file).
        (True, Path("/host/route_localnet"), [(Path("/host/route_localnet"), 1)]),
        (False, None, []),
    ],
)
def test_route_localnet_is_set_only_with_localhost_node_ports(
    localhost: bool, route_localnet: Path | None, expected: list[tuple[Path, int]]
) -> None:
    kernel = Kernel()
    settings = dataclasses.replace(SETTINGS, localhost_node_ports=localhost)
    kernel.backend(settings, route_localnet).sync(sample_state(), None)
    assert kernel.sysctls == expected


def test_ensure_sysctl_writes_only_a_different_value(tmp_path: Path) -> None:
    target = tmp_path / "route_localnet"
    target.write_text("1\n")
    before = target.stat().st_mtime_ns
    ipt_kernel.ensure_sysctl(target, 1)
    assert target.stat().st_mtime_ns == before  # the same value: not written
    target.write_text("0\n")
    ipt_kernel.ensure_sysctl(target, 1)
    assert target.read_text() == "1\n"
    with pytest.raises(OSError):
        ipt_kernel.ensure_sysctl(tmp_path / "missing", 1)


def many_ports(count: int) -> NodeLocalState:
    ports = [
        ServicePort(
            key(f"s{i}"),
            80,
            cluster_ips=(IP.of(f"10.96.{i // 250}.{i % 250 + 1}"),),
            cluster_endpoints=endpoints(f"10.244.{i // 250}.{i % 250 + 1}"),
        )
        for i in range(count)
    ]
    return local_state(NODE, SETTINGS, ports)


@pytest.mark.parametrize(
    ("chains", "lines", "rules_in_table", "listed"),
    [
        (10_000, 120_000, 0, True),  # a start: the table is empty
        (10_000, 120_000, 120_000, True),  # a restart at 10,000 Services
        (99, 1_000_000, 0, False),  # few chains: their lookups cost little
        (1_000, 12_000, 12_000, False),  # a restart at 1,000: listing would cost more
        (300, 5_000, 200_000, False),  # a small sync into a large table
    ],
)
def test_a_full_sync_lists_the_table_first_where_the_lookups_cost_more(
    chains: int, lines: int, rules_in_table: int, listed: bool
) -> None:
    assert script.lists_first(chains, lines, rules_in_table) is listed


def test_the_listing_comes_after_the_jump_edits_and_only_the_chains_they_name() -> None:
    """A built-in chain named after the listing is not created, and every chain declared
    before it costs the listing a search of them all (iptables-nft 1.8.9)."""
    kernel = Kernel()
    kernel.nf_tables_flavour = True
    kernel.backend().sync(many_ports(200), None)
    nat = next(s for f, s in kernel.scripts if f == 4 and s.startswith("*nat")).splitlines()
    at = nat.index(script.LIST_FIRST)
    assert nat[1:at] == [
        f":{n.POSTROUTING} - [0:0]",
        f":{n.SERVICES} - [0:0]",
        *(line for line in nat[1:at] if line.startswith("-I ")),
    ]
    assert sorted(line.split()[1] for line in nat[1:at] if line.startswith("-I ")) == [
        "OUTPUT",
        "POSTROUTING",
        "PREROUTING",
    ]
    after = nat[at + 1 :]
    assert not [line for line in after if line.startswith(("-I ", "-D "))]
    declared_after = {line[1:].split()[0] for line in after if line.startswith(":")}
    assert sum(c.startswith(n.SVC_PREFIX) for c in declared_after) == 200
    assert_declared_before_use("\n".join(nat))
    # Small scripts (the filter table's, a partial sync's) and legacy iptables do not list.
    assert all(script.LIST_FIRST not in s.splitlines() for f, s in kernel.scripts[1:])
    state = many_ports(200)
    backend = kernel.backend()
    backend.sync(state, None)
    changed = dataclasses.replace(state.services[key("s7")], port=81)
    state.services[changed.key] = changed
    done = len(kernel.scripts)
    backend.sync(state, [changed.key])
    assert kernel.scripts[done:]
    assert all(script.LIST_FIRST not in s.splitlines() for _, s in kernel.scripts[done:])
    legacy = Kernel()
    legacy.backend().sync(many_ports(200), None)
    assert all(script.LIST_FIRST not in s.splitlines() for _, s in legacy.scripts)


def test_the_fake_takes_the_listing_as_a_change_of_nothing() -> None:
    fake = FakeIptables()
    fake.nf_tables_flavour = True
    scripts: list[str] = []
    restore = fake.restore
    fake.restore = lambda family, text: (scripts.append(text), restore(family, text))[1]  # type: ignore[method-assign]
    backend = IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda _path, _value: None)
    backend.sync(many_ports(150), None)
    assert any(script.LIST_FIRST in s.splitlines() for s in scripts)
    assert sum(c.startswith(n.SVC_PREFIX) for c in fake.tables[(4, "nat")]) == 150


def test_the_rules_a_sync_wrote_are_counted_per_family_and_table() -> None:
    """Upstream's kubeproxy_sync_proxy_rules_iptables_last: the rules the last sync wrote,
    counted from its scripts (which are not kept: 16 MB at 10,000 Services)."""
    kernel = Kernel()
    backend = kernel.backend()
    state = many_ports(20)
    backend.sync(state, None)

    def rules(scripts: list[tuple[int, str]]) -> dict[tuple[int, str], int]:
        out: dict[tuple[int, str], int] = {}
        for fam, text in scripts:
            table = ""
            for line in text.splitlines():
                if line.startswith("*"):
                    table = line[1:]
                elif line.startswith(("-A ", "-I ")):
                    out[(fam, table)] = out.get((fam, table), 0) + 1
        return out

    full = rules(kernel.scripts)
    assert full[(4, "nat")] > 20 and backend.last_written == full
    counts = backend.rule_counts()
    assert counts[(4, "nat")][1] == full[(4, "nat")]
    done = len(kernel.scripts)
    changed = next(iter(state.services.values()))
    state.services[changed.key] = dataclasses.replace(changed, cluster_endpoints=())
    backend.sync(state, [changed.key])
    partial = rules(kernel.scripts[done:])
    assert partial and backend.last_written == partial
    assert backend.rule_counts()[(4, "filter")][1] == partial.get((4, "filter"), 0)


class Reading(FakeIptables):
    """A fake whose restore reads the pieces one by one, noting how many service ports had
    been rendered when each piece arrived."""

    def __init__(self, rendered: list[int]) -> None:
        super().__init__()
        self.rendered = rendered
        self.seen: list[tuple[int, int, str]] = []  # (family, ports rendered, piece)

    def restore_pieces(self, family: int, pieces: Iterable[str]) -> None:
        text = []
        for piece in pieces:
            self.seen.append((family, self.rendered[0], piece))
            text.append(piece)
        self.restore(family, "".join(text))


def synced_while_read(
    monkeypatch: pytest.MonkeyPatch, nf_tables: bool
) -> tuple[IptablesBackend, Reading, list[tuple[int, str]]]:
    """A full sync of 50 ports into a `Reading` fake of either flavour, with every port's
    rendering counted: the backend, the fake, and the IPv4 nat table's pieces as (ports
    rendered when the piece was read, piece)."""
    from kpx_agent.backends.iptables import backend as backend_module

    rendered = [0]

    def counting(*args: object) -> object:
        rendered[0] += 1
        return port_rules(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backend_module, "port_rules", counting)
    fake = Reading(rendered)
    fake.nf_tables_flavour = nf_tables
    backend = IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda _path, _value: None)
    backend.sync(many_ports(50), None)
    nat = [(ports, piece) for fam, ports, piece in fake.seen if fam == 4][:-1]  # (filter)
    return backend, fake, nat


def test_legacy_iptables_gets_the_nat_script_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Legacy iptables-restore holds the xtables lock from a table's first line to its
    COMMIT: the script is rendered whole before the tool starts reading it."""
    _, _, nat = synced_while_read(monkeypatch, nf_tables=False)
    assert len(nat) == 1 and nat[0][0] == 50
    assert nat[0][1].startswith("*nat\n") and nat[0][1].endswith("COMMIT\n")


def test_a_full_sync_renders_the_ports_while_the_tool_reads_the_nat_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nat table's script goes to iptables-nft in pieces as the ports are rendered, so
    the tool parses it while the agent renders the rest (docs/benchmarks.md); the tables it
    leaves are those of the record's chains written whole (`table_script`)."""
    backend, fake, nat = synced_while_read(monkeypatch, nf_tables=True)
    assert nat[0][0] == 0 and nat[0][1].startswith("*nat\n")  # before any port
    assert [ports for ports, _ in nat[1:-1]] == list(range(1, 51))  # each port as rendered
    assert all(piece.startswith(f":{n.SVC_PREFIX}") for _, piece in nat[1:-1])
    assert nat[-1][0] == 50 and nat[-1][1].endswith("COMMIT\n")
    whole = FakeIptables()
    for fam in (4, 6):
        chains = backend._books[fam].table_chains  # type: ignore[index]
        for table in n.TABLES:
            edits = script.jump_edits(table, script.SavedTable(), backend._jumps[fam])
            whole.restore(fam, script.table_script(table, dict(chains(table)), edits))
    assert fake.dump() == whole.dump()


def test_a_port_that_fails_to_render_in_a_full_sync_applies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rendering bug half-way through the streamed script: the tool never reads a COMMIT
    (the fake applies nothing), the sync fails, and the next is a full one again."""
    from kpx_agent.backends.iptables import backend as backend_module

    state = many_ports(20)
    fake = FakeIptables()
    backend = IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda _path, _value: None)
    before = fake.dump()
    calls = [0]

    def failing(*args: object) -> object:
        calls[0] += 1
        if calls[0] == 10:
            raise RuntimeError("a bug")
        return port_rules(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backend_module, "port_rules", failing)
    with pytest.raises(RuntimeError):
        backend.sync(state, None)
    assert fake.dump() == before and fake.runs == 0
    monkeypatch.setattr(backend_module, "port_rules", port_rules)
    backend.sync(state, [next(iter(state.services))])  # not partial: nothing is known
    assert sum(c.startswith(n.SVC_PREFIX) for c in fake.tables[(4, "nat")]) == 20


def test_a_restart_deletes_the_chains_of_ports_gone_meanwhile() -> None:
    """A full sync into tables holding chains it no longer wants (a Service deleted while
    the agent was down) empties them before it deletes them: a chain with rules cannot be
    deleted (the fake refuses it as the kernel does, EBUSY)."""
    fake = FakeIptables()
    state = many_ports(30)
    IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda _path, _value: None).sync(state, None)
    gone = next(iter(state.services))
    del state.services[gone]
    IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda _path, _value: None).sync(state, None)
    assert sum(c.startswith(n.SVC_PREFIX) for c in fake.tables[(4, "nat")]) == 29
    assert "10.96.0.1 " not in fake.dump() and "10.96.0.2/32" in fake.dump()
