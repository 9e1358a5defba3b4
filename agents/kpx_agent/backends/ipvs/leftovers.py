"""Pure: which of a node's IPVS state a kpx ipvs agent made, so that another kpx mode's agent
removes that and nothing else.

kpx's ipvs mode and upstream kube-proxy's ipvs mode use the same dummy interface name
(`kube-ipvs0`) and neither tags a virtual server. An agent of another kpx mode that removes
"the ipvs mode's leftovers" after its first verified sync must not take upstream kube-proxy's
(they go only through the takeover path, once kube-proxy's Pod is gone from the node:
kpx_agent/handover/from_kube_proxy.py) nor anyone else's. So:

1. The node's virtual servers and kube-ipvs0 may be kpx's only when kpx's helper table
   `kpx-ipvs` (`ip` or `ip6`) is on the node - every kpx ipvs sync writes it - and none of the
   chains only kube-proxy's ipvs mode creates is (`IPVS_MODE_CHAINS`). Otherwise no virtual
   server is touched and kube-ipvs0 stays; only the `kpx-ipvs` tables (kpx's alone) go.
2. On a kpx node, a virtual server is kpx's when it is outside `excludeCIDRs` and
   - the helper table names it (sets `cluster-ips`, `masquerade-ips`, `drop-ports`: every
     cluster IP, every external one with externalTrafficPolicy Cluster, every one without
     endpoints that drops), or
   - its address is on kube-ipvs0 (cluster, external and load-balancer IPs), or
   - it has real servers and every one is an endpoint the table names (set `hairpin` holds
     every endpoint kpx programmed): a NodePort of an externalTrafficPolicy Local Service.
   Anything else (someone's virtual server on a node address, say) stays.
3. kube-ipvs0 then goes, and the helper tables last, so that a removal that fails halfway
   keeps the mark that makes the retry find the rest.
4. Drain: a virtual server of kpx's that IPVS still has established connections through
   (IPVS's active count, `draining`) stays, with kube-ipvs0 and the tables, until they have
   ended. Closing TCP connections (TIME_WAIT, 2 min in IPVS) and UDP flows are not waited
   for, as upstream's graceful termination does not wait for UDP. The new mode's rules
   already take every new connection (its DNAT comes first, in prerouting); those
   established through IPVS have their translation in IPVS's own connection table only, so
   removing their virtual server or its address would reset them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from ipaddress import ip_address
from typing import Any, Final

from ...model.types import IPNetwork
from ..kernel.names import IPVS_TABLE, NFT_FAMILIES
from .model import CLUSTER_IPS, DROP, HAIRPIN, MASQ_IPS, VirtualKey, excluded

TABLE: Final = IPVS_TABLE
MARK_SETS: Final = (CLUSTER_IPS, MASQ_IPS, DROP)
FAMILIES: Final = {keyword: family for family, keyword in NFT_FAMILIES.items()}

#: (address, protocol, port): an endpoint, or a virtual server's address without family.
Triple = tuple[str, str, int]


def _addr(text: object) -> str:
    return str(ip_address(str(text)))


@dataclass(frozen=True)
class KpxMarks:
    """What kpx's ipvs helper tables say: which families have one, the virtual servers they
    name, the endpoints they name."""

    families: frozenset[int] = frozenset()
    virtual_servers: frozenset[tuple[int, str, str, int]] = frozenset()
    endpoints: frozenset[Triple] = frozenset()


def parse_marks(listings: Mapping[str, str | None]) -> KpxMarks:
    """From `nft -j list table FAMILY kpx-ipvs` per nft family ("ip", "ip6"; None: no table)."""
    families: set[int] = set()
    servers: set[tuple[int, str, str, int]] = set()
    endpoints: set[Triple] = set()
    for nft_family, text in listings.items():
        if text is None:
            continue
        family = FAMILIES[nft_family]
        families.add(family)
        for item in json.loads(text).get("nftables", []):
            nft_set: dict[str, Any] | None = item.get("set")
            if not nft_set or nft_set.get("table") != TABLE:
                continue
            for elem in nft_set.get("elem") or []:
                fields = elem.get("concat") if isinstance(elem, dict) else None
                if not isinstance(fields, list) or len(fields) < 3:
                    continue
                address, protocol, port = _addr(fields[0]), str(fields[1]), int(fields[2])
                if nft_set.get("name") in MARK_SETS:
                    servers.add((family, protocol, address, port))
                elif nft_set.get("name") == HAIRPIN:
                    endpoints.add((address, protocol, port))
    return KpxMarks(frozenset(families), frozenset(servers), frozenset(endpoints))


@dataclass(frozen=True)
class IpvsCleanup:
    """What the other modes' cleanup removes of the ipvs mode's state on this node."""

    virtual_servers: tuple[VirtualKey, ...]
    dummy: bool
    tables: tuple[int, ...]  # families whose kpx-ipvs table goes
    why: str


def plan_cleanup(
    marks: KpxMarks,
    kube_proxy_ipvs: bool,
    virtual_servers: Mapping[VirtualKey, Iterable[tuple[str, int]]],
    bound: Iterable[tuple[int, str]],
    exclude_cidrs: tuple[IPNetwork, ...] = (),
) -> IpvsCleanup:
    """See the module docstring. `virtual_servers`: each on the node with its real servers
    (address, port); `bound`: (family, address) on kube-ipvs0; `kube_proxy_ipvs`: whether a
    chain of kube-proxy's ipvs mode is on the node."""
    tables = tuple(sorted(marks.families))
    if not marks.families:
        return IpvsCleanup((), False, (), "no kpx-ipvs table: the IPVS state is not kpx's")
    if kube_proxy_ipvs:
        return IpvsCleanup(
            (),
            False,
            tables,
            "kube-proxy's ipvs mode is on this node: its "
            "virtual servers and kube-ipvs0 go only with the takeover",
        )
    on_dummy = {(family, _addr(address)) for family, address in bound}
    mine = []
    for key, real_servers in virtual_servers.items():
        address = _addr(key.address)
        if excluded(address, exclude_cidrs):
            continue
        reals = {(_addr(a), key.protocol, int(p)) for a, p in real_servers}
        if (
            (key.family, key.protocol, address, key.port) in marks.virtual_servers
            or (key.family, address) in on_dummy
            or (reals and reals <= marks.endpoints)
        ):
            mine.append(key)
    return IpvsCleanup(tuple(sorted(mine)), True, tables, "a kpx ipvs agent's state")


def draining(
    virtual_servers: Iterable[VirtualKey], connections: Mapping[VirtualKey, int]
) -> tuple[list[VirtualKey], list[VirtualKey]]:
    """Pure: (removable now, draining): which of kpx's virtual servers IPVS still has
    established connections through (`connections`: IPVS's active count per virtual
    server)."""
    now: list[VirtualKey] = []
    later: list[VirtualKey] = []
    for key in virtual_servers:
        (later if connections.get(key, 0) > 0 else now).append(key)
    return now, later
