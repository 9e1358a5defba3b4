"""Preflight before a mode switch: the agent's verdicts per mode (pure), the Event message
(people read it), and what a switch drops."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kpx_agent.handover.preflight import NodeFacts, decide, gather
from kpx_api import parse_spec
from kpx_api.preflight import (
    DroppedSetting,
    ModeCheck,
    dropped_settings,
    format_report,
)

OK = NodeFacts(kernel="6.1.0", nft="nftables v1.0.6", ip_vs_loaded=True, ipvsadm=True)


def verdicts(facts: NodeFacts) -> dict[str, bool]:
    return {c.mode: c.ok for c in decide(facts)}


def test_a_node_with_everything_runs_every_mode() -> None:
    assert verdicts(OK) == {"nftables": True, "iptables": True, "ipvs": True}


def test_each_missing_piece_rules_out_its_mode_only() -> None:
    no_nft = NodeFacts(kernel="6.1.0", ip_vs_loaded=True)
    assert verdicts(no_nft) == {"nftables": False, "iptables": True, "ipvs": True}
    refused = NodeFacts(kernel="4.19", nft="nftables v0.9.0", nft_check="Operation not supported")
    (nft, *_rest) = decide(refused)
    assert not nft.ok and "Operation not supported" in nft.detail and "4.19" in nft.detail
    tools = NodeFacts(nft="nft", missing_iptables_tools=("ip6tables-restore",), ip_vs_loaded=True)
    iptables = decide(tools)[1]
    assert not iptables.ok and iptables.detail == "not installed: ip6tables-restore"
    assert verdicts(NodeFacts(nft="nft"))["ipvs"] is False
    loadable = decide(NodeFacts(nft="nft", ip_vs_module=True))[2]
    assert loadable.ok and "not loaded but available" in loadable.detail
    assert "ipvsadm is not installed" in loadable.detail


def test_gather_reads_the_tools_answers_and_the_kernels_module_lists(tmp_path: Path) -> None:
    import os

    release = os.uname().release
    (tmp_path / "modules" / release).mkdir(parents=True)
    (tmp_path / "modules" / release / "modules.dep").write_text(
        "kernel/net/netfilter/ipvs/ip_vs.ko: kernel/net/netfilter/nf_conntrack.ko\n"
    )
    (tmp_path / "proc" / "net").mkdir(parents=True)
    calls: list[tuple[list[str], str | None]] = []

    def run(argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        calls.append((argv, stdin))
        if argv[:2] == ["nft", "--check"]:
            return subprocess.CompletedProcess(argv, 1, "", "Error: Could not process rule")
        return subprocess.CompletedProcess(argv, 0, "nftables v1.0.6\n", "")

    facts = gather(run, proc=tmp_path / "proc", modules=tmp_path / "modules")
    assert facts.ip_vs_module and not facts.ip_vs_loaded
    if facts.nft is not None:  # nft installed here: its check ran on the test table
        assert facts.nft == "nftables v1.0.6"
        assert facts.nft_check == "Error: Could not process rule"
        assert any(
            argv[:2] == ["nft", "--check"] and "hook input" in (stdin or "")
            for argv, stdin in calls
        )


def test_the_event_message_has_one_line_per_mode() -> None:
    checks = decide(NodeFacts(kernel="6.1.0", nft="nftables v1.0.6"))
    lines = format_report(checks).splitlines()
    assert lines[0] == "nftables: ok (nftables v1.0.6, kernel 6.1.0)"
    assert [line.split(":")[0] for line in lines] == [c.mode for c in checks]
    assert format_report([ModeCheck("ipvs", False, "a\nb")]) == "ipvs: no (a b)"


def test_dropped_settings_of_a_switch() -> None:
    block = {"acknowledgeDeprecation": True, "scheduler": "lc", "udpTimeout": "30s"}
    ipvs = parse_spec({"mode": "ipvs", "ipvs": block})
    nftables = parse_spec({"mode": "nftables"})
    dropped = dropped_settings(ipvs, nftables)
    assert [d.setting for d in dropped] == [
        DroppedSetting.IPVS_SCHEDULER,
        DroppedSetting.IPVS_TIMEOUTS,
    ]
    assert "udpTimeout=30s" in dropped[1].detail
    assert dropped_settings(ipvs, ipvs) == []  # no switch
    plain = parse_spec({"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True}})
    assert dropped_settings(plain, nftables) == []  # rr and kernel timeouts: nothing lost
    iptables = parse_spec({"mode": "iptables"})  # localhostNodePorts is on by default
    lost = dropped_settings(iptables, nftables)  # off by default in nftables mode
    assert [d.setting for d in lost] == [DroppedSetting.LOCALHOST_NODE_PORTS]
    assert "set nftables.localhostNodePorts: true" in lost[0].detail
    off = parse_spec({"mode": "iptables", "iptables": {"localhostNodePorts": False}})
    assert dropped_settings(off, nftables) == []


def test_localhost_node_ports_carry_over_to_nftables_when_set() -> None:
    """iptables -> nftables keeps NodePorts on 127.0.0.1 when the new spec turns them on:
    nothing to accept. Without it, or where the new nodePortAddresses leaves 127.0.0.1 out,
    they are lost (and must be accepted); ipvs has none."""
    iptables = parse_spec({"mode": "iptables"})
    carried = parse_spec({"mode": "nftables", "nftables": {"localhostNodePorts": True}})
    assert dropped_settings(iptables, carried) == []
    # Back again: iptables has them on by default.
    assert dropped_settings(carried, parse_spec({"mode": "iptables"})) == []
    lost = dropped_settings(
        carried, parse_spec({"mode": "iptables", "iptables": {"localhostNodePorts": False}})
    )
    assert [d.setting for d in lost] == [DroppedSetting.LOCALHOST_NODE_PORTS]
    elsewhere = parse_spec(
        {
            "mode": "nftables",
            "nftables": {"localhostNodePorts": True},
            "nodePortAddresses": ["10.0.0.0/8"],
        }
    )
    (held,) = dropped_settings(iptables, elsewhere)
    assert held.setting is DroppedSetting.LOCALHOST_NODE_PORTS
    assert "leaves 127.0.0.1 out" in held.detail
    ipvs = parse_spec({"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True}})
    (none,) = dropped_settings(iptables, ipvs)
    assert "mode ipvs has none" in none.detail
