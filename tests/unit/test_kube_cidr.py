"""CIDRs read as Kubernetes reads them (k8s.io/utils/net ParseCIDRSloppy)."""

from __future__ import annotations

from ipaddress import ip_network

import pytest

from kpx_agent.model.kube_cidr import parse_cidr_sloppy


@pytest.mark.parametrize(
    ("text", "network"),
    [
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("10.1.2.3/8", "10.0.0.0/8"),  # host bits masked, as Go's ParseCIDR does
        ("010.0.0.0/8", "10.0.0.0/8"),  # leading zeros: decimal, not octal
        ("192.168.001.010/32", "192.168.1.10/32"),
        ("010.0.0.0/08", "10.0.0.0/8"),
        ("::ffff:10.0.0.0/104", "10.0.0.0/8"),  # IPv4-mapped: IPv4, prefix minus 96
        ("::ffff:a00:0/104", "10.0.0.0/8"),
        ("::ffff:192.0.2.1/128", "192.0.2.1/32"),
        ("::ffff:010.0.0.0/104", "10.0.0.0/8"),
        ("::ffff:0:0/96", "0.0.0.0/0"),
        ("::ffff:10.0.0.0/80", "::/80"),  # the mask takes the ::ffff: marker away: IPv6
        ("fd00::/64", "fd00::/64"),
        ("fd00::1/64", "fd00::/64"),
    ],
)
def test_read_as_kubernetes_does(text: str, network: str) -> None:
    assert parse_cidr_sloppy(text) == ip_network(network)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "10.0.0.0",
        "10.0.0.0/33",
        "256.0.0.0/8",
        "10.0.0/8",
        "10.0.0.0/-1",
        "10.0.0.0/8 ",
        "fd00::/129",
        "::ffff:300.0.0.0/104",
        "10.0.0.0/a",
        "0x0a.0.0.0/8",
        " 10.0.0.0/8",
    ],
)
def test_what_kubernetes_does_not_read_either(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cidr_sloppy(text)
