"""iptables rules as typed values: each match's and target's restore text, the comment's
quoting as iptables-save prints it, rules compared as values, and every chain a sync writes
made of typed rules that jump only to chains that exist."""

from __future__ import annotations

from ipaddress import ip_network

import pytest
from backend_samples import GOLDEN, NODE, SETTINGS, sample_state, with_richer_endpoints

from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables import rule as r
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import IptScripts
from kpx_agent.backends.iptables.rules import fixed_chains, port_rules, shared_frames
from kpx_agent.model.service_ports import node_facts
from kpx_agent.model.types import IP, Protocol


@pytest.mark.parametrize(
    ("match", "text"),
    [
        (r.Source(IP.of("10.0.0.1")), "-s 10.0.0.1/32"),
        (r.Source(IP.of("fd00::1"), negate=True), "! -s fd00::1/128"),
        (r.Destination(ip_network("10.244.0.0/16")), "-d 10.244.0.0/16"),
        (r.InInterface("veth+", negate=True), "! -i veth+"),
        (r.Proto(Protocol.UDP), "-p udp"),
        (r.DestinationPort(Protocol.SCTP, 80), "-p sctp -m sctp --dport 80"),
        (r.Comment("kpx"), "-m comment --comment kpx"),
        (r.Comment("default/web:http/tcp/v4"), '-m comment --comment "default/web:http/tcp/v4"'),
        (r.AddrType.SOURCE_LOCAL, "-m addrtype --src-type LOCAL"),
        (
            r.CtState(("RELATED", "ESTABLISHED"), negate=True),
            "-m conntrack ! --ctstate RELATED,ESTABLISHED",
        ),
        (r.Mark(0x4000, negate=True), "-m mark ! --mark 0x4000/0x4000"),
        (r.Random(1 / 3), "-m statistic --mode random --probability 0.3333333333"),
        (r.Recent("KPX-AFF-X"), "-m recent --name KPX-AFF-X --set"),
        (r.Recent("KPX-AFF-X", 60), "-m recent --name KPX-AFF-X --update --seconds 60 --reap"),
    ],
)
def test_each_match_has_one_restore_text(match: r.Match, text: str) -> None:
    assert r.rule(match, target=r.Verdict.RETURN).text == f"{text} -j RETURN"


@pytest.mark.parametrize(
    ("target", "text"),
    [
        (r.Jump("KPX-SERVICES"), "-j KPX-SERVICES"),
        (r.Verdict.REJECT, "-j REJECT"),
        (r.Dnat(IP.of("10.244.1.2"), 8080), "-j DNAT --to-destination 10.244.1.2:8080"),
        (r.Dnat(IP.of("fd00::2"), 8080), "-j DNAT --to-destination [fd00::2]:8080"),
        (r.MarkOr(0x4000), "-j MARK --or-mark 0x4000"),
        (r.MarkXor(0x4000), "-j MARK --xor-mark 0x4000"),
        (r.Masquerade(), "-j MASQUERADE --random-fully"),
    ],
)
def test_each_target_has_one_restore_text(target: r.Target, text: str) -> None:
    assert r.rule(target=target).text == text
    assert str(r.rule(r.Proto(Protocol.TCP), target=target)) == f"-p tcp {text}"


def test_a_comment_that_would_need_escaping_is_refused() -> None:
    for text in ('a"b', "a\\b", "a'b", "a\nb", ""):
        with pytest.raises(ValueError, match="escaping"):
            r.Comment(text)


def test_rules_are_values() -> None:
    a = r.rule(r.Destination(IP.of("10.0.0.1")), target=r.Jump("KPX-X"))
    b = r.Rule((r.Destination(IP.of("10.0.0.1")),), r.Jump("KPX-X"))
    c = r.rule(r.Source(IP.of("10.0.0.1")), target=r.Jump("KPX-X"))
    assert a == b and hash(a) == hash(b) and a != c
    assert len({a, b, c}) == 2


def test_our_jump_rules_read_as_iptables_save_prints_them() -> None:
    """A full sync finds its jump rules in iptables-save output by their text."""
    texts = {(t, chain, n.jump_rule(m, target).text) for t, chain, m, target in n.JUMPS}
    assert (n.NAT, "PREROUTING", "-m comment --comment kpx -j KPX-SERVICES") in texts
    assert (
        n.FILTER,
        "INPUT",
        "-m conntrack --ctstate NEW -m comment --comment kpx -j KPX-FILTER",
    ) in texts


@pytest.mark.parametrize("family", [4, 6])
def test_every_chain_is_typed_rules_jumping_to_chains_that_exist(family: int) -> None:
    facts = node_facts(SETTINGS, NODE)[family]
    state = sample_state()
    chains = dict(fixed_chains(SETTINGS, facts))
    frames = shared_frames(SETTINGS, facts)
    chains.update({cid: head + tail for cid, (head, tail) in frames.items()})
    for sp in state.services.values():
        if sp.family == family:
            produced = port_rules(sp, SETTINGS, facts.local_pods)
            chains.update(produced.own)
            for cid, rules in produced.shared.items():
                chains[cid] = (*chains[cid], *rules)
    assert any(table == n.NAT and c.startswith(n.SVC_PREFIX) for table, c in chains)
    for (table, _), rules in chains.items():
        for rule in rules:
            assert isinstance(rule, r.Rule)
            if isinstance(rule.target, r.Jump):
                assert (table, rule.target.chain) in chains, rule


def test_endpoints_carrying_more_fields_render_the_same() -> None:
    """The backend reads an endpoint's address, port and locality by name: an endpoint that
    carries more (conditions, hints) renders the golden scripts unchanged."""
    kernel = IptScripts()
    IptablesBackend(SETTINGS, kernel).sync(with_richer_endpoints(sample_state()), None)
    for fam in (4, 6):
        text = "".join(s for f, s in kernel.scripts if f == fam)
        assert text == (GOLDEN / "iptables" / f"full_sync.v{fam}.rules").read_text()
