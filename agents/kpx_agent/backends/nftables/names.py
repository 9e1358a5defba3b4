"""Every kernel object the nftables backend owns is named here (the table and the family
keywords in the toolkit's `kernel.names`), and nowhere else."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable

from ..kernel.names import NFT_ADDR_TYPE as ADDR_TYPE
from ..kernel.names import NFT_FAMILIES as FAMILIES
from ..kernel.names import NFT_TABLE as TABLE

__all__ = ["ADDR_TYPE", "FAMILIES", "TABLE"]

DADDR = {family: f"{keyword} daddr" for family, keyword in FAMILIES.items()}
SADDR = {family: f"{keyword} saddr" for family, keyword in FAMILIES.items()}

# Base chains (hooked) and the regular chains they jump to.
NAT_PREROUTING = "nat-prerouting"
NAT_OUTPUT = "nat-output"
NAT_POSTROUTING = "nat-postrouting"
FILTER_INPUT = "filter-input"
FILTER_FORWARD = "filter-forward"
FILTER_OUTPUT = "filter-output"
SERVICES = "services"
NO_ENDPOINTS = "no-endpoints"

# Sets and maps (their elements are what a sync changes).
SERVICE_IPS = "service-ips"  # vip . proto . port : goto endpoints-<n>
SERVICE_NODEPORTS = "service-nodeports"  # proto . port : goto nodeport-endpoints-<n>
# externalTrafficPolicy Local: traffic from a local pod or the node itself to the external
# addresses goes to every cluster endpoint instead ("short circuit", consulted first).
SHORT_CIRCUIT_IPS = "short-circuit-ips"  # vip . proto . port : goto short-circuit-endpoints-<n>
SHORT_CIRCUIT_NODEPORTS = "short-circuit-nodeports"  # : goto short-circuit-nodeport-endpoints-<n>
# The same keys as plain sets, for the node's own traffic, which is masqueraded: a verdict map
# cannot be looked up as a set (Linux 6.1 refuses the rule; later kernels accept it).
SHORT_CIRCUIT_IP_KEYS = "short-circuit-ip-keys"  # vip . proto . port
SHORT_CIRCUIT_NODEPORT_KEYS = "short-circuit-nodeport-keys"  # proto . port
# Per endpoint count n, a chain and a map of the same name (see endpoints_chain below):
#   endpoints-<n>           vip . proto . port . bucket : endpoint-ip . port
#   nodeport-endpoints-<n>  proto . port . bucket : endpoint-ip . port
#   short-circuit-endpoints-<n>, short-circuit-nodeport-endpoints-<n>: the same, for the
#   short-circuit dispatch (the same VIP key as in endpoints-<n>, other endpoints)
CLUSTER_IPS = "cluster-ips"  # vip . proto . port: masquerade when from off-cluster
EXTERNAL_IPS = "external-ips"  # vip . proto . port: masquerade (externalTrafficPolicy Cluster)
EXTERNAL_NODEPORTS = "external-nodeports"  # proto . port: masquerade (Cluster policy)
REJECT_IPS = "reject-ips"  # vip . proto . port with no endpoints
REJECT_NODEPORTS = "reject-nodeports"  # proto . port with no endpoints
DROP_IPS = "drop-ips"  # vip . proto . port with no local endpoints (Local traffic policy)
DROP_NODEPORTS = "drop-nodeports"  # proto . port with no local endpoints
HAIRPIN = "hairpin"  # endpoint . endpoint: a pod reaching itself through a VIP
FIREWALL_IPS = "firewall-ips"  # vip . proto . port of load balancers with source ranges
FIREWALL_ALLOW = "firewall-allow"  # vip . proto . port . source-range allowed to reach them
FIREWALL = "firewall"  # drops traffic to those load balancers from anywhere else
FIREWALL_PREROUTING = "firewall-prerouting"
FIREWALL_OUTPUT = "firewall-output"
NODEPORT_ADDRESSES = "nodeport-addresses"  # local addresses NodePorts answer on
LOCAL_POD_CIDRS = "local-pod-cidrs"  # detectLocal networks, when a family has several


# Each dispatch map's endpoint chains (and their maps) are named <prefix><count>.
ENDPOINT_CHAIN_PREFIX = {
    SERVICE_IPS: "endpoints-",
    SERVICE_NODEPORTS: "nodeport-endpoints-",
    SHORT_CIRCUIT_IPS: "short-circuit-endpoints-",
    SHORT_CIRCUIT_NODEPORTS: "short-circuit-nodeport-endpoints-",
}
NODEPORT_DISPATCH = frozenset((SERVICE_NODEPORTS, SHORT_CIRCUIT_NODEPORTS))


def endpoint_chain_of(dispatch_map: str, count: int) -> str:
    """The chain (and map) that picks one of `count` endpoints for `dispatch_map`'s keys."""
    return f"{ENDPOINT_CHAIN_PREFIX[dispatch_map]}{count}"


def endpoints_chain(count: int) -> str:
    """The chain that picks one of `count` endpoints of a VIP at random, and its map."""
    return endpoint_chain_of(SERVICE_IPS, count)


def nodeport_endpoints_chain(count: int) -> str:
    return endpoint_chain_of(SERVICE_NODEPORTS, count)


def endpoint_count_of(name: str) -> tuple[str, int] | None:
    """For an endpoint chain or map name (`endpoints-<n>`, `nodeport-endpoints-<n>`, ...): the
    dispatch map that jumps to it and `n`; None for any other name."""
    for dispatch, prefix in ENDPOINT_CHAIN_PREFIX.items():
        count = name.removeprefix(prefix)
        if count != name and count.isdigit():
            return dispatch, int(count)
    return None


def _short_hash(*parts: object) -> str:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:12]


def affinity_chain(
    port_key: object, timeout: int, endpoints: Iterable[tuple[str, int, bool]]
) -> str:
    """The chain of one service port with session affinity: `aff-<hash>` of the port, its
    timeout and its endpoints, each (address, port, local) (new endpoints, new chain). The
    endpoints are spelled as they always were, so a chain keeps its name across versions
    (whatever else an endpoint comes to carry)."""
    spelled = [
        f"Endpoint(ip={ip!r}, port={port!r}, local={local!r})" for ip, port, local in endpoints
    ]
    return f"aff-{_short_hash(port_key, timeout, spelled)}"


def affinity_set(port_key: object, timeout: int, ip: str, port: int) -> str:
    """The set of recent clients of one endpoint of one service port with session affinity:
    `aff-<hash of the port and its timeout>-<hash of the endpoint>`. As upstream's per-endpoint
    affinity sets: the same for every chain of the port (all endpoints, node-local ones) and
    whatever its other endpoints do, so a client stays with its endpoint while others come and
    go; a full sync keeps these sets' elements (`in_place`)."""
    return f"aff-{_short_hash(port_key, timeout)}-{_short_hash(ip, port)}"


_AFFINITY_SET = re.compile(r"aff-[a-z2-7]{12}-[a-z2-7]{12}")


def is_affinity_set(name: str) -> bool:
    """Whether `name` has the form of an affinity set (`affinity_set`)."""
    return _AFFINITY_SET.fullmatch(name) is not None
