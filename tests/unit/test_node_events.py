"""The migration tests' explanation of a failed try (kpx_cluster.node_events.explain, and
kpx_cluster.migration's reading of the agents' log stamps): pure parts; the listeners run in
tests/e2e/test_node_events_netns.py."""

from __future__ import annotations

import datetime
import socket

from kpx_cluster.migration import _log_time
from kpx_cluster.migration_load import failure
from kpx_cluster.node_events import Line, explain

T = 1_800_000_000.0
TARGET = "10.242.0.4:30319"
NO_DNAT = (
    "[NEW] tcp      6 120 SYN_SENT src=10.244.1.9 dst=10.242.0.4 sport=40000 dport=30319 "
    "[UNREPLIED] src=10.242.0.4 dst=10.244.1.9 sport=30319 dport=40000"
)
OTHER_PORT = NO_DNAT.replace("dport=30319 [", "dport=80 [")
# the reply tuple's port is the target's: only the original direction counts
REPLY_ONLY = (
    "[NEW] tcp      6 120 SYN_SENT src=10.244.1.9 dst=10.96.0.10 sport=30319 dport=80 "
    "[UNREPLIED] src=10.242.0.4 dst=10.244.1.9 sport=30319 dport=40000"
)


def test_a_failure_is_explained_by_the_rules_before_it_and_its_own_connection() -> None:
    lines = [
        Line(T - 5.0, "n1", "nft", "add rule ip nat PREROUTING too early"),
        Line(T - 2.0, "n3", "nft", "delete rule ip nat PREROUTING handle 4"),
        Line(T + 0.01, "n3", "conntrack", NO_DNAT),
        Line(T + 0.02, "n3", "conntrack", OTHER_PORT),
        Line(T + 0.03, "n3", "conntrack", REPLY_ONLY),
        Line(T + 0.5, "n2", "nft", "add element inet kpx service-ips { ... }"),
        Line(T + 2.0, "n3", "conntrack", NO_DNAT),  # a later try's
    ]
    out = explain(lines, [(T, TARGET, "ConnectionRefusedError")])
    assert out[0].startswith("-- ") and TARGET in out[0] and "ConnectionRefusedError" in out[0]
    assert [line.split()[2:4] for line in out[1:]] == [
        ["n3", "nft:"],
        ["n3", "conntrack:"],
        ["n2", "nft:"],
    ]
    assert out[1].split()[1] == "-2.000s" and out[2].split()[1] == "+0.010s"


def test_only_the_first_failures_are_explained_and_none_found_says_so() -> None:
    failures = [(T + i, TARGET, "timeout") for i in (3, 0, 2, 1)]
    out = explain([], failures, first=2)
    assert [line for line in out if line.startswith("-- ")] == [
        f"-- {_clock(T)} {TARGET} timeout: what the nodes did around it",
        f"-- {_clock(T + 1)} {TARGET} timeout: what the nodes did around it",
    ]
    assert out[1] == "   (no ruleset change on any node, no new connection to it seen)"


def _clock(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]


def test_agent_log_stamps_read_to_the_fraction_and_lines_without_one_read_as_zero() -> None:
    stamp = datetime.datetime(2026, 11, 28, 18, 30, 1, tzinfo=datetime.UTC).timestamp()
    assert _log_time("2026-11-28T18:30:01.123456789Z INFO synced") == stamp + 0.123456789
    assert _log_time("2026-11-28T18:30:01Z INFO synced") == stamp
    assert _log_time("unable to retrieve container logs") == 0.0
    assert _log_time("") == 0.0


def test_a_failure_that_names_its_source_port_is_explained_by_that_connection_only() -> None:
    retried = NO_DNAT.replace("sport=40000", "sport=40002")
    lines = [
        Line(T + 0.01, "n3", "conntrack", NO_DNAT),  # another try to the same target
        Line(T + 0.02, "n1", "conntrack", NO_DNAT.replace("sport=40000", "sport=40002")),
        Line(T + 3.0, "n3", "conntrack", retried),  # its SYN again, after a rule changed
    ]
    out = explain(lines, [(T, TARGET, "timeout (port 40002)")])
    assert [(line.split()[1], line.split()[2]) for line in out[1:]] == [
        ("+0.020s", "n1"),
        ("+3.000s", "n3"),
    ]


def test_a_failed_try_names_its_source_port_while_it_has_one() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert failure("timeout", sock) == f"timeout (port {port})"
    assert failure("ConnectionRefusedError", sock) == "ConnectionRefusedError"  # closed
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as unbound:
        assert failure("timeout", unbound) == "timeout"
