"""Drift in a real kernel (a fresh netns per test): rules changed behind the agent's back (an
element deleted, a chain flushed, a rule or a jump deleted) are found by the periodic check
(Proxier.check_kernel, what the agent runs every syncPeriod) and rewritten by the full sync it
asks for; the agent's own syncs and other writers' commits elsewhere are not drift."""

from __future__ import annotations

import json
import sys

import pytest

from kpx_cluster.netns import Topology

pytestmark = pytest.mark.netns

# Runs inside n1's netns: argv = mode, then JSON [[label, damage argv], ...]. Prints JSON
# {label: {"reasons": [...], "restored": bool}}: what the periodic check after the damage
# found, and whether the full sync it asked for made the agent's rules what they were.
PROGRAM = """
import json, subprocess, sys
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.model.types import DataplaneSettings
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.sync.proxier import Proxier
from kpx_api.proxysettings import NamespaceOptOut
mode, steps = sys.argv[1], json.loads(sys.argv[2])
if mode == "nftables":
    from kpx_agent.backends.nftables.backend import NftablesBackend as Backend
    def ours():
        return "".join(subprocess.run(["nft", "list", "table", fam, "kpx"], check=True,
                                      capture_output=True, text=True).stdout
                       for fam in ("ip", "ip6"))
else:
    from kpx_agent.backends.iptables.backend import IptablesBackend as Backend
    def ours():
        out = []
        for tool in ("iptables-save", "ip6tables-save"):
            for table in ("nat", "filter"):
                text = subprocess.run([tool, "-t", table], check=True, capture_output=True,
                                      text=True).stdout
                out += [l for l in text.splitlines() if "KPX" in l or "kpx" in l]
        return "\\n".join(out)

def service(name, ip, ip6, **spec):
    return {"metadata": {"namespace": "d", "name": name},
            "spec": {"clusterIPs": [ip, ip6], "ipFamilies": ["IPv4", "IPv6"],
                     "ports": [{"port": 80, "protocol": "TCP"}], **spec}}
def slice_(name, family, *ips):
    return {"metadata": {"namespace": "d", "name": f"{name}-{family}",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": family, "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip]} for ip in ips]}
state = ClusterState()
for kind in (SERVICES, SLICES, NAMESPACES, NODES):
    state.replace(kind, [])
state.upsert(SERVICES, service("web", "10.96.0.10", "fd00:96::10"))
state.upsert(SERVICES, service("sticky", "10.96.0.14", "fd00:96::14", sessionAffinity="ClientIP"))
for name in ("web", "sticky"):
    state.upsert(SLICES, slice_(name, "IPv4", "10.244.1.2", "10.244.2.2"))
    state.upsert(SLICES, slice_(name, "IPv6", "fd00:244:1::2"))
settings = DataplaneSettings()
proxier = Proxier(state, Backend(settings), "n1", NamespaceOptOut(), AgentMetrics(), settings)
proxier.delete_flows = lambda flows: 0
assert proxier.sync().full
def check():
    return [f"{found.kind}: {found.detail}" for found in proxier.check_kernel()]
result = {"after the first sync": {"reasons": check()}}
# The agent's own partial sync (a new endpoint) is not drift either.
state.upsert(SLICES, slice_("web", "IPv4", "10.244.1.2", "10.244.2.2", "10.244.3.2"))
outcome = proxier.sync()
assert outcome.ok and not outcome.full, outcome
result["after a partial sync"] = {"reasons": check()}
# What the repairs are compared with: the kernel after a full sync of this state.
proxier.request_full_sync("test")
assert proxier.sync().full
assert check() == []  # a syncPeriod passes
programmed = ours()
for label, damage in steps:
    subprocess.run(damage, check=True, capture_output=True, text=True)
    findings = proxier.check_kernel()
    reasons = [f"{found.kind}: {found.detail}" for found in findings]
    proxier.repair(findings)
    if state.has_changes():
        assert proxier.sync().ok
    now = ours()
    result[label] = {"reasons": reasons, "restored": now == programmed}
    if now != programmed:
        import difflib
        print("\\n".join(difflib.unified_diff(programmed.splitlines(), now.splitlines())),
              file=sys.stderr)
    assert check() == [], label  # repaired: nothing found again
print(json.dumps(result))
"""


def run(topology: Topology, mode: str, steps: list[tuple[str, list[str]]]) -> dict[str, dict]:
    n1 = topology.add_node("n1")
    argv = [sys.executable, "-c", PROGRAM, mode, json.dumps(steps)]
    out = topology.exec(n1, argv, check=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


# A client recorded in an affinity set, as the data path's `update @aff-...` records it (with
# its own expiry), in a commit: the generation moves, and the set's elements differ from the
# agent's last commit.
RECORD_CLIENT = """
import re, subprocess
listed = subprocess.run(["nft", "list", "sets", "ip"], capture_output=True, text=True, check=True)
name = re.search(r"set (aff-[a-z2-7]{12}-[a-z2-7]{12}) ", listed.stdout).group(1)
subprocess.run(["nft", f"add element ip kpx {name} {{ 10.1.2.3 timeout 300s }}"], check=True)
"""


def test_nftables_drift_is_found_and_repaired(topology: Topology) -> None:
    result = run(
        topology,
        "nftables",
        [
            ("another table", ["nft", "add table ip other-writer"]),
            (
                "element deleted",
                ["nft", "delete element ip kpx service-ips { 10.96.0.10 . tcp . 80 }"],
            ),
            ("chain flushed", ["nft", "flush chain ip6 kpx services"]),
            ("rule added", ["nft", "insert rule ip kpx services accept"]),
            # last: the recorded client stays in the table, which other steps compare
            ("affinity recorded", [sys.executable, "-c", RECORD_CLIENT]),
        ],
    )
    # The session affinity sets are the data path's to fill: not drift (no full sync, which
    # would also cost every client its affinity if it emptied them).
    assert result["affinity recorded"]["reasons"] == [], result
    assert result["after the first sync"]["reasons"] == []
    assert result["after a partial sync"]["reasons"] == []
    assert result["another table"] == {"reasons": [], "restored": True}
    for label, family in (
        ("element deleted", "ip"),
        ("chain flushed", "ip6"),
        ("rule added", "ip"),
    ):
        assert result[label]["reasons"] == [f"drift: our {family} table changed behind our back"], (
            result
        )
        assert result[label]["restored"], result


def test_iptables_drift_is_found_and_repaired(topology: Topology) -> None:
    result = run(
        topology,
        "iptables",
        [
            ("another chain", ["iptables", "-t", "nat", "-N", "OTHER-WRITER"]),
            ("rule deleted", ["iptables", "-t", "nat", "-D", "KPX-SERVICES", "1"]),
            ("chain flushed", ["ip6tables", "-t", "nat", "-F", "KPX-SERVICES"]),
            (
                "jump deleted",
                [
                    "iptables",
                    "-t",
                    "nat",
                    "-D",
                    "PREROUTING",
                    "-m",
                    "comment",
                    "--comment",
                    "kpx",
                    "-j",
                    "KPX-SERVICES",
                ],
            ),
            ("rule replaced", ["iptables", "-t", "nat", "-R", "KPX-SERVICES", "1", "-j", "RETURN"]),
        ],
    )
    assert result["after the first sync"]["reasons"] == []
    assert result["after a partial sync"]["reasons"] == []
    assert result["another chain"] == {"reasons": [], "restored": True}
    for label in ("rule deleted", "chain flushed", "jump deleted", "rule replaced"):
        assert len(result[label]["reasons"]) == 1, result
        assert result[label]["reasons"][0].startswith("drift: IPv"), result
        assert result[label]["restored"], result
