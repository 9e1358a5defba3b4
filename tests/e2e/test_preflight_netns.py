"""The agent's preflight in a real node netns: `nft --check` has this kernel validate the test
table without committing it (nothing is left behind), and the verdicts follow the node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kpx_cluster.netns import Topology

pytestmark = pytest.mark.netns

CHECK = """
import json
from kpx_agent.handover.preflight import decide, gather
facts = gather()
print(json.dumps({"facts": {"nft": facts.nft, "nft_check": facts.nft_check,
                            "ip_vs_loaded": facts.ip_vs_loaded},
                  "verdicts": {c.mode: [c.ok, c.detail] for c in decide(facts)}}))
"""


def test_preflight_checks_the_kernel_and_leaves_nothing(topology: Topology) -> None:
    node = topology.add_node("n1")
    result = topology.exec(node, [sys.executable, "-c", CHECK], timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["facts"]["nft"] and out["facts"]["nft_check"] is None, out
    assert out["verdicts"]["nftables"][0] is True, out
    # ip_vs loaded on this host: the verdict says so (this CI kernel has none: "no").
    if Path("/proc/net/ip_vs").exists():
        assert out["verdicts"]["ipvs"][0] is True, out
    tables = topology.exec(node, ["nft", "list", "tables"], check=True).stdout
    assert "kpx-preflight" not in tables, tables
