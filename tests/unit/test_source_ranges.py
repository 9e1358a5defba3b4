"""The source ranges Services share on one load-balancer IP and port (pure)."""

from __future__ import annotations

from ipaddress import ip_network

from kpx_agent.backends.source_ranges import common_ranges, merged


def nets(*texts: str) -> tuple[object, ...]:
    return tuple(ip_network(t) for t in texts)


def test_merged_collapses_overlaps_per_family() -> None:
    found = merged(ip_network(t) for t in ("10.1.0.0/16", "10.0.0.0/8", "fd00::/8", "fd00:1::/32"))
    assert found == nets("10.0.0.0/8", "fd00::/8")


def test_what_every_service_allows() -> None:
    one = [ip_network("10.0.0.0/8"), ip_network("192.168.0.0/16")]
    two = [ip_network("10.1.0.0/16"), ip_network("192.168.7.0/24"), ip_network("172.16.0.0/12")]
    assert common_ranges([one, two]) == nets("10.1.0.0/16", "192.168.7.0/24")
    assert common_ranges([two, one]) == common_ranges([one, two])  # order does not matter
    assert common_ranges([one]) == nets("10.0.0.0/8", "192.168.0.0/16")
    # Nothing in common: nothing gets through; no Service: no ranges.
    assert common_ranges([[ip_network("10.0.0.0/8")], [ip_network("11.0.0.0/8")]]) == ()
    assert common_ranges([]) == ()
    # Families never meet.
    assert common_ranges([[ip_network("::/0")], [ip_network("10.0.0.0/8")]]) == ()
