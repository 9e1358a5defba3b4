"""loadBalancerSourceRanges that several Services share on one load-balancer IP and port.

Two Services may claim the same load-balancer address and port (a second tenant, a shared
IP), each with its own allowed source ranges. The kernel's firewall sets hold one interval per
range and refuse overlapping ones, so what the Services share is resolved before rendering:
one list of ranges per address and port, those every Service allows. That is upstream's
iptables mode, where each Service's firewall chain in turn drops what it does not allow; the
result does not depend on the order the Services arrived in, so every node programs the same.
Nothing in common: nothing gets through.

Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Network, IPv6Network, collapse_addresses

from ..model.types import IPNetwork


def merged(nets: Iterable[IPNetwork]) -> tuple[IPNetwork, ...]:
    """The same addresses with overlaps merged (IPv4 first, then IPv6)."""
    nets = tuple(nets)
    v4 = [x for x in nets if isinstance(x, IPv4Network)]
    v6 = [x for x in nets if isinstance(x, IPv6Network)]
    return (*collapse_addresses(v4), *collapse_addresses(v6))


def common_ranges(each: Iterable[Iterable[IPNetwork]]) -> tuple[IPNetwork, ...]:
    """The addresses in every one of the lists of ranges (no list: none), merged."""
    common: list[IPNetwork] | None = None
    for ranges in each:
        nets = list(ranges)
        if common is None:
            common = nets
            continue
        # Two CIDR blocks either nest or are apart: the overlap of two is the smaller one.
        common = [
            a if a.prefixlen >= b.prefixlen else b
            for a in common
            for b in nets
            if a.version == b.version and a.overlaps(b)
        ]
    return merged(common or ())
