"""Pure: which of a node's rules are upstream kube-proxy's, and the script that removes them.

Upstream kube-proxy (iptables and ipvs modes) owns, in the nat, filter and mangle tables of
both families: its fixed chains (`OWNED_CHAINS`), its per-Service chains (`OWNED_PREFIXES`),
and the rules of the built-in chains that jump to them. Other `KUBE-*` chains are the
kubelet's (KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT, KUBE-MARK-DROP) and stay, as
does every rule of any other chain. A chain of kube-proxy's that a rule of someone else's
chain still jumps to stays too (deleting it would fail, and break that rule): the plan names it.

In nftables mode kube-proxy owns the tables `ip kube-proxy` and `ip6 kube-proxy`, nothing else.

`plan_table(table, save_text)` takes one table's `iptables-save -t TABLE` output and returns
the `iptables-restore --noflush` script (empty when there is nothing of kube-proxy's): delete
the jumps from the built-in chains, flush every owned chain, then delete them - one atomic
commit per table.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

TABLES: Final = ("nat", "filter", "mangle")
BUILTIN: Final = frozenset(
    {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
)  # every built-in chain of nat, filter and mangle
#: kube-proxy's fixed chains (iptables and ipvs modes, current and older releases).
OWNED_CHAINS: Final = frozenset(
    {
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-FORWARD",
        "KUBE-PROXY-FIREWALL",
        "KUBE-PROXY-CANARY",
        # ipvs mode
        "KUBE-NODE-PORT",
        "KUBE-LOAD-BALANCER",
        "KUBE-SOURCE-RANGES-FIREWALL",
        "KUBE-IPVS-FILTER",
        "KUBE-IPVS-OUT-FILTER",
    }
)
#: kube-proxy's per-Service-port and per-endpoint chains.
OWNED_PREFIXES: Final = (
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
)
NFT_TABLES: Final = ("ip kube-proxy", "ip6 kube-proxy")
_TARGET = re.compile(r"(?:^|\s)-[jg]\s+(\S+)")


def owned(chain: str) -> bool:
    return chain in OWNED_CHAINS or chain.startswith(OWNED_PREFIXES)


@dataclass
class TablePlan:
    table: str
    jumps: list[str] = field(default_factory=list)  # "-D CHAIN spec" lines
    chains: list[str] = field(default_factory=list)  # owned chains to flush and delete
    kept: list[str] = field(default_factory=list)  # owned chains still referenced by others

    def script(self) -> str:
        if not self.jumps and not self.chains:
            return ""
        lines = [f"*{self.table}", *self.jumps]
        lines += [f"-F {chain}" for chain in self.chains]
        lines += [f"-X {chain}" for chain in self.chains]
        return "\n".join([*lines, "COMMIT", ""])


def _parse(save_text: str, table: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The chains declared in `table` and its rules as (chain, spec after `-A CHAIN `)."""
    chains: list[str] = []
    rules: list[tuple[str, str]] = []
    current = None
    for raw in save_text.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            current = line[1:]
        elif current != table:
            continue
        elif line.startswith(":"):
            chains.append(line[1:].split()[0])
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            rules.append((chain, spec))
    return chains, rules


def _target(spec: str) -> str | None:
    match = _TARGET.search(spec)
    return match.group(1) if match else None


def plan_table(table: str, save_text: str) -> TablePlan:
    """What removing kube-proxy's rules from `table` takes (see the module docstring)."""
    chains, rules = _parse(save_text, table)
    doomed = {c for c in chains if owned(c) and c not in BUILTIN}
    kept: set[str] = set()
    # A foreign (neither built-in nor kube-proxy's) chain jumping into an owned chain keeps it,
    # and whatever it jumps to in turn.
    changed = True
    while changed:
        changed = False
        for chain, spec in rules:
            target = _target(spec)
            if target in doomed and chain not in BUILTIN and chain not in doomed:
                doomed.discard(target)
                kept.add(target)
                changed = True
    plan = TablePlan(table, kept=sorted(kept))
    for chain, spec in rules:
        if chain in BUILTIN and _target(spec) in doomed:
            plan.jumps.append(f"-D {chain} {spec}")
    plan.chains = [c for c in chains if c in doomed]
    return plan


def nft_script(tables: Iterable[str]) -> str:
    return "".join(f"delete table {t}\n" for t in tables)


def describe(plans: Iterable[TablePlan]) -> str:
    """One line for the log: what a plan removes."""
    parts = []
    for p in plans:
        if p.jumps or p.chains or p.kept:
            text = f"{p.table}: {len(p.jumps)} jumps, {len(p.chains)} chains"
            if p.kept:
                text += f" (kept, used by other rules: {' '.join(map(shlex.quote, p.kept))})"
            parts.append(text)
    return "; ".join(parts) or "nothing"


#: Chains only upstream kube-proxy's ipvs mode creates (its iptables mode creates none of
#: them): while any is on the node, kube-proxy's ipvs mode is (or was) here, and the node's
#: IPVS virtual servers and kube-ipvs0 are (also) its.
IPVS_MODE_CHAINS: Final = frozenset(
    {
        "KUBE-NODE-PORT",
        "KUBE-LOAD-BALANCER",
        "KUBE-SOURCE-RANGES-FIREWALL",
        "KUBE-IPVS-FILTER",
        "KUBE-IPVS-OUT-FILTER",
    }
)


def ipvs_mode_chains(table: str, save_text: str) -> set[str]:
    """The chains of kube-proxy's ipvs mode declared in `table` of `iptables-save` output."""
    chains, _rules = _parse(save_text, table)
    return set(IPVS_MODE_CHAINS.intersection(chains))


#: The ipsets of upstream kube-proxy's ipvs mode (pkg/proxy/ipvs/ipset.go, v1.36 and older
#: releases); the IPv6 proxier names its own with "KUBE-6-" for "KUBE-".
_IPSET_STEMS: Final = (
    "LOOP-BACK",
    "CLUSTER-IP",
    "EXTERNAL-IP",
    "EXTERNAL-IP-LOCAL",
    "LOAD-BALANCER",
    "LOAD-BALANCER-LOCAL",
    "LOAD-BALANCER-FW",
    "LOAD-BALANCER-SOURCE-IP",
    "LOAD-BALANCER-SOURCE-CIDR",
    "LOAD-BALANCER-MASQ",
    "NODE-PORT-TCP",
    "NODE-PORT-LOCAL-TCP",
    "NODE-PORT-UDP",
    "NODE-PORT-LOCAL-UDP",
    "NODE-PORT-SCTP-HASH",
    "NODE-PORT-LOCAL-SCTP-HASH",
    "HEALTH-CHECK-NODE-PORT",
    "IPVS-IPS",
    "MASQ-ALL",
    "CLUSTER-CIDR",
    "SERVICE-ACCESS",
)
IPSETS: Final = frozenset(f"KUBE-{infix}{stem}" for stem in _IPSET_STEMS for infix in ("", "6-"))


def ipsets_to_destroy(names: Iterable[str]) -> list[str]:
    """Pure: which of a node's ipset names are kube-proxy's (exact names, never a prefix:
    an ipset of someone else's that starts with KUBE- stays)."""
    return sorted(set(names) & IPSETS)
