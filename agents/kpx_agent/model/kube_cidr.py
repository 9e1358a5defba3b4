"""CIDRs read as Kubernetes reads them (k8s.io/utils/net ParseCIDRSloppy, Go 1.16's parser).

Python's `ipaddress` differs from it in two ways that matter for what a Service says:

* an IPv4 octet with leading zeros (`010.0.0.0/8`) is refused by Python; Go 1.16 and
  ParseCIDRSloppy read it as decimal (10.0.0.0/8);
* an IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) is IPv6 to Python; to Go the masked
  address is an IPv4 address in IPv6 form, so the network is IPv4 10.0.0.0/8 (the prefix
  minus 96) everywhere Kubernetes uses it (family split, containment, String()). A prefix
  under 96 masks the ::ffff: marker away: that stays an IPv6 network, in Go as here.

A v1.36 apiserver refuses both forms in new objects, but older clusters and objects stored
before accept them, and kube-proxy reads them this way. Pure.
"""

from __future__ import annotations

import re
from ipaddress import IPv4Network, IPv6Network, ip_network

IPNetwork = IPv4Network | IPv6Network

_V4 = re.compile(r"(\d+)\.(\d+)\.(\d+)\.(\d+)")
_PREFIX = re.compile(r"\d+")
_MAPPED = IPv6Network("::ffff:0:0/96")


def _sloppy_v4(text: str) -> str | None:
    """A dotted quad with leading zeros read as decimal, in canonical form; None if invalid."""
    m = _V4.fullmatch(text)
    if m is None:
        return None
    octets = [int(x) for x in m.groups()]
    if any(o > 255 for o in octets):
        return None
    return ".".join(map(str, octets))


def parse_cidr_sloppy(text: str) -> IPNetwork:
    """A CIDR as Kubernetes reads it (host bits are masked, as Go's ParseCIDR does). Raises
    ValueError for anything Kubernetes would not read either."""
    address, slash, prefix = text.partition("/")
    if not slash or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"not a CIDR: {text!r}")
    if ":" in address:
        head, _, tail = address.rpartition(":")
        if "." in tail:  # an embedded IPv4 address (its octets are sloppy too in Go)
            v4 = _sloppy_v4(tail)
            if v4 is None:
                raise ValueError(f"not a CIDR: {text!r}")
            address = f"{head}:{v4}"
        net = ip_network(f"{address}/{int(prefix)}", strict=False)
        assert isinstance(net, IPv6Network)
        if net.prefixlen >= 96 and net.network_address in _MAPPED:
            mapped = net.network_address.ipv4_mapped
            assert mapped is not None
            return IPv4Network(f"{mapped}/{net.prefixlen - 96}")
        return net
    v4 = _sloppy_v4(address)
    if v4 is None:
        raise ValueError(f"not a CIDR: {text!r}")
    return ip_network(f"{v4}/{int(prefix)}", strict=False)
