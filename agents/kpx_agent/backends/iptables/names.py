"""Every kernel object the iptables backend owns is named here, and nowhere else."""

from __future__ import annotations

import base64
import hashlib
from typing import Final

from ...model.types import Endpoint, ServicePortKey
from .rule import Comment, CtState, Match, Rule, jump

PREFIX: Final = "KPX-"
COMMENT: Final = "kpx"  # the comment on our jump rules in the built-in chains
MAX_CHAIN_NAME: Final = 28  # XT_EXTENSION_MAXNAMELEN - 1

NAT: Final = "nat"
FILTER: Final = "filter"
TABLES: Final = (NAT, FILTER)

RESTORE: Final = {4: "iptables-restore", 6: "ip6tables-restore"}
SAVE: Final = {4: "iptables-save", 6: "ip6tables-save"}
LIST: Final = {4: "iptables", 6: "ip6tables"}

# nat table
SERVICES: Final = "KPX-SERVICES"  # every VIP (cluster, external, load-balancer IP) of every port
NODEPORTS: Final = "KPX-NODEPORTS"  # every NodePort; reached from the end of KPX-SERVICES
POSTROUTING: Final = "KPX-POSTROUTING"  # masquerade what KPX-MARK-MASQ marked, and hairpins
HAIRPIN: Final = "KPX-HAIRPIN"  # mark a local endpoint that reached itself through a VIP
MARK_MASQ: Final = "KPX-MARK-MASQ"  # set the masquerade mark bit
OFF_CLUSTER: Final = "KPX-OFF-CLUSTER"  # mark sources outside every cluster CIDR (2+ CIDRs)

# filter table
FILTER_CHAIN: Final = "KPX-FILTER"  # new connections (INPUT, OUTPUT, and from KPX-FORWARD)
FORWARD: Final = "KPX-FORWARD"  # FORWARD: KPX-FILTER, then accept what we forward (KUBE-FORWARD)
LOCALNET: Final = "KPX-LOCALNET"  # localhost NodePorts: drop martians to 127.0.0.0/8 (IPv4)
FIREWALL: Final = "KPX-FIREWALL"  # loadBalancerSourceRanges: drop what the nat FW chain refused
REJECT: Final = "KPX-REJECT"  # VIP ports without endpoints: REJECT (or DROP)
NODEPORTS_REJECT: Final = "KPX-NODEPORTS-REJECT"  # NodePorts without endpoints: REJECT (or DROP)

# Per service port chains (nat): <prefix><16 chars of base32(sha256(...))>.
SVC_PREFIX: Final = "KPX-SVC-"  # pick one cluster endpoint
EXT_PREFIX: Final = "KPX-EXT-"  # external traffic: masquerade mark, then pick an endpoint
FW_PREFIX: Final = "KPX-FW-"  # load-balancer IP source-range check
# externalTrafficPolicy Local, when both policies are Local: every cluster endpoint, for
# traffic from local pods and the node itself (the "short circuit"; otherwise KPX-SVC- is it).
SHORT_PREFIX: Final = "KPX-SHORT-"
# Not a chain: the `recent` list of one endpoint of a service port with session affinity.
AFFINITY_PREFIX: Final = "KPX-AFF-"

Jump = tuple[str, str, tuple[Match, ...], str]
_NEW: Final = (CtState(("NEW",)),)
# The jumps from built-in chains to ours: (table, built-in chain, matches, our chain), in
# order within a built-in chain. Their text is as iptables-save prints it, so a full sync
# recognises its rules.
JUMPS: Final[tuple[Jump, ...]] = (
    (NAT, "PREROUTING", (), SERVICES),
    (NAT, "OUTPUT", (), SERVICES),
    (NAT, "POSTROUTING", (), POSTROUTING),
    (FILTER, "INPUT", _NEW, FILTER_CHAIN),
    (FILTER, "FORWARD", (), FORWARD),
    (FILTER, "OUTPUT", _NEW, FILTER_CHAIN),
)
# With localhost NodePorts (IPv4 only): every packet to the node, and every packet it sends.
LOCALNET_JUMPS: Final[tuple[Jump, ...]] = (
    (FILTER, "INPUT", (), LOCALNET),
    (FILTER, "OUTPUT", (), LOCALNET),
)


def jumps(localnet_guard: bool) -> tuple[Jump, ...]:
    """The jump rules a family's tables need."""
    return JUMPS + LOCALNET_JUMPS if localnet_guard else JUMPS


def jump_rule(matches: tuple[Match, ...], chain: str) -> Rule:
    """A jump rule from a built-in chain to ours, marked with our comment."""
    return Rule((*matches, Comment(COMMENT)), jump(chain))


def _hash(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return base64.b32encode(digest).decode()[:16]


def port_hash(key: ServicePortKey) -> str:
    """Stable for a service port (namespace, name, port name, protocol, family)."""
    return _hash(str(key))


def port_chains(key: ServicePortKey) -> tuple[str, str, str, str]:
    """The SVC, EXT, FW and SHORT chains of a service port (its hash made once)."""
    h = port_hash(key)
    return SVC_PREFIX + h, EXT_PREFIX + h, FW_PREFIX + h, SHORT_PREFIX + h


def svc_chain(key: ServicePortKey) -> str:
    return SVC_PREFIX + port_hash(key)


def ext_chain(key: ServicePortKey) -> str:
    return EXT_PREFIX + port_hash(key)


def fw_chain(key: ServicePortKey) -> str:
    return FW_PREFIX + port_hash(key)


def short_chain(key: ServicePortKey) -> str:
    return SHORT_PREFIX + port_hash(key)


def affinity_list(key: ServicePortKey, ep: Endpoint) -> str:
    """The `recent` list remembering the clients sent to one endpoint of one service port."""
    return AFFINITY_PREFIX + _hash(f"{key}|{ep.ip}|{ep.port}")


def is_ours(chain: str) -> bool:
    return chain.startswith(PREFIX)
