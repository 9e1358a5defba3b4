"""Which addresses a Service may claim in spec.externalIPs on this node (externalIPs.allowedCIDRs).

Anyone who may create a Service may name any address in spec.externalIPs, and every node then
takes that address's traffic for the Service (CVE-2020-8554). Upstream kube-proxy programs them
all and documents restricting them with admission control. The model lets through:

* never: an unspecified, loopback, link-local or multicast address (no traffic for a Service
  is ever addressed to one; taking 127.0.0.1 or 169.254.169.254 is an attack);
* with `externalIPs.allowedCIDRs` set: only addresses inside those networks;
* otherwise (the default): every other address but this node's own (taking them would take
  the node's own services: SSH, the kubelet) and the apiserver's (the addresses of the
  endpoints of default/kubernetes: taking them would take the cluster's control plane, the
  agent's own watch included).

A Service's ClusterIP needs no rule here: a ClusterIP always wins a clash (vip_claims.py).
The agent knows no other node's addresses and no Service CIDR (it watches its own Node only):
to keep externalIPs out of those networks cluster-wide, list the allowed networks.

Pure: the proxier builds the policy from the settings, its Node and the apiserver's endpoints.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .types import IP, IPAddress, IPNetwork

APISERVER_SERVICE = ("default", "kubernetes")


@dataclass(frozen=True, slots=True)
class ExternalIPPolicy:
    allowed: tuple[IPNetwork, ...] = ()  # externalIPs.allowedCIDRs; empty: the default
    node_addresses: frozenset[IPAddress] = frozenset()
    apiserver_addresses: frozenset[IPAddress] = frozenset()

    def refusal(self, ip: IPAddress) -> str | None:
        """Why `ip` may not be an external IP here, or None when it may."""
        address = ipaddress.ip_address(ip)
        for special, what in (
            (address.is_unspecified, "an unspecified address"),
            (address.is_loopback, "a loopback address"),
            (address.is_link_local, "a link-local address"),
            (address.is_multicast, "a multicast address"),
        ):
            if special:
                return f"it is {what}"
        if self.allowed:
            if any(address in net for net in self.allowed if net.version == address.version):
                return None
            return "it is outside externalIPs.allowedCIDRs"
        if ip in self.node_addresses:
            return "it is an address of this node (list it in externalIPs.allowedCIDRs to allow)"
        if ip in self.apiserver_addresses:
            return "it is an address of the apiserver (an endpoint of default/kubernetes)"
        return None


def apiserver_addresses(slices: Iterable[Mapping[str, Any]]) -> frozenset[IPAddress]:
    """The endpoint addresses of default/kubernetes's EndpointSlices."""
    found = set()
    for sl in slices:
        for ep in sl.get("endpoints") or []:
            for value in ep.get("addresses") or []:
                if (ip := IP.parse(value)) is not None:
                    found.add(ip)
    return frozenset(found)
