"""The migration load's counting and report (kpx_cluster.migration_load, kpx_cluster.migration):
pure parts; the load itself runs in tests/e2e/test_migration_under_load.py."""

from __future__ import annotations

from kpx_cluster.migration import SwitchResult, agent_mode, table_row
from kpx_cluster.migration_load import SLOW, Held, Summary, Tries, split_target


def _summary(tcp_failed: int = 0, udp_failed: int = 0, held_error: str = "") -> Summary:
    tcp, udp = Tries(tried=100), Tries(tried=50)
    for i in range(tcp_failed):
        tcp.fail(float(i), "10.96.0.10:80", "timeout")
    for i in range(udp_failed):
        udp.fail(float(i), "10.96.0.10:53", "timeout")
    tcp.answer("web-1", 0.01)
    tcp.answer("web-1", SLOW + 0.1)
    udp.answer("web-2", 0.01)
    held = [Held("10.96.0.10:81", 30, ["web-1"], held_error), Held("10.96.0.10:81", 30, ["web-2"])]
    return Summary(10.0, tcp, udp, held)


def test_summary_survives_its_json_and_counts_slow_answers() -> None:
    summary = _summary(tcp_failed=2, held_error="3.1s: ConnectionResetError")
    back = Summary.from_json(summary.to_json())
    assert back == summary
    assert back.tcp.failed == 2 and back.tcp.slow == 1 and back.tcp.backends == {"web-1": 2}
    assert back.tcp.failures[0] == (0.0, "10.96.0.10:80", "timeout")
    assert back.held_survived == 1


def test_held_connection_survives_only_on_one_backend_without_error() -> None:
    assert Held("a:1", 3, ["x"]).survived
    assert not Held("a:1", 3, ["x", "y"]).survived  # moved to another backend: not the same
    assert not Held("a:1", 0, []).survived
    assert not Held("a:1", 3, ["x"], "reset").survived


def test_failures_name_every_problem_and_none_when_clean() -> None:
    clean = SwitchResult("iptables", "nftables", 3, 20.0, [_summary(), _summary()], {})
    assert clean.failures() == []
    row = table_row(clean)
    assert row.startswith("| iptables -> nftables | 3 | 20.0 | 10.0 | 200 / 0 (2) | 100 / 0 (0)")
    assert row.endswith("| 4 of 4 | none |")

    bad = SwitchResult(
        "iptables",
        "nftables",
        3,
        20.0,
        [_summary(tcp_failed=1), _summary(udp_failed=2, held_error="reset")],
        {"n1": ["iptables-nft-save: :KPX-SERVICES - [0:0]"]},
    )
    problems = bad.failures()
    assert len(problems) == 4, problems
    assert any("1 of 100 new connections failed" in p for p in problems)
    assert any("2 of 50 UDP exchanges lost" in p for p in problems)
    assert any("held connection broke: reset" in p for p in problems)
    assert any(p.startswith("n1: 1 iptables leftovers") for p in problems)
    assert table_row(bad).endswith("| 3 of 4 | 1 |")


def test_split_target_and_agent_mode() -> None:
    assert split_target("10.96.0.1:80") == ("10.96.0.1", 80)
    assert split_target("[fd00::1]:53") == ("fd00::1", 53)
    args = ["--mode", "nftables", "--config", "/c"]
    pod = {"spec": {"containers": [{"command": ["proxy-agent"], "args": args}]}}
    assert agent_mode(pod) == "nftables"
    assert agent_mode({"spec": {"containers": [{"args": []}]}}) == ""
