"""The floor under each mode's cold start: the tool alone loading the agent's own ruleset.

For N Services x 10 endpoints (bench/workload.py's, as the node-local state built in-process, no
control plane), the
agent's backends render their full-sync transactions exactly as they would at start; then, in
a fresh network namespace each, the timed load is `nft -f` of the nftables transaction, and
`iptables-restore --noflush` / `ip6tables-restore --noflush` of the iptables scripts, in the
order the backend applies them. Compare with the agents' cold starts from `make bench`
(bench/results/compare-<N>.md): the difference is what the agent adds on top of the kernel.

Usage: python3 bench/floors.py [--services N ...]    (default: 1000 10000)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import uuid
from pathlib import Path

from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import IptScripts
from kpx_agent.backends.iptables.kernel import nf_tables_flavour
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import NftScripts
from kpx_agent.model.types import NodeLocalState
from workload import SETTINGS, node_local_state

RESULTS = Path(__file__).parent / "results"
RESTORE = {4: "iptables-restore", 6: "ip6tables-restore"}


def nft_script(st: NodeLocalState) -> str:
    """A full sync's nft text, both families (one run each), every element in it: the tables
    are there (`NftScripts`), so nothing goes by netlink."""
    kernel = NftScripts()
    NftablesBackend(SETTINGS, kernel).sync(st, None)
    return "".join(kernel.runs)


def iptables_scripts(st: NodeLocalState) -> list[tuple[int, str]]:
    """A full sync's scripts into empty tables, as the agent writes them on this machine's
    iptables (the nf_tables flavour lists the table before the rules: script.LIST_FIRST)."""
    kernel = IptScripts(nf_tables=nf_tables_flavour())
    IptablesBackend(SETTINGS, kernel).sync(st, None)
    return kernel.scripts


def timed_in_fresh_netns(loads: list[tuple[list[str], str]]) -> float:
    """Seconds to run each (argv, stdin) in order inside a new, empty network namespace."""
    ns = f"kpxfloor{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        start = time.monotonic()
        for argv, stdin in loads:
            subprocess.run(
                ["ip", "netns", "exec", ns, *argv],
                input=stdin,
                text=True,
                check=True,
                capture_output=True,
            )
        return time.monotonic() - start
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def measure(n: int, runs: int = 3) -> dict[str, object]:
    st = node_local_state(n)
    nft = nft_script(st)
    ipt = iptables_scripts(st)
    nft_s = sorted(timed_in_fresh_netns([(["nft", "-f", "-"], nft)]) for _ in range(runs))
    ipt_loads = [([RESTORE[fam], "--noflush"], script) for fam, script in ipt]
    ipt_s = sorted(timed_in_fresh_netns(ipt_loads) for _ in range(runs))
    return {
        "services": n,
        "nft_f_seconds": nft_s,
        "nft_script_bytes": len(nft.encode()),
        "iptables_restore_seconds": ipt_s,
        "iptables_script_bytes": sum(len(s.encode()) for _, s in ipt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, nargs="*", default=[1000, 10000])
    args = parser.parse_args()
    print(
        "| Services | nft -f (kpx nftables ruleset), median | iptables-restore (kpx iptables"
        " ruleset), median |\n|---|---|---|"
    )
    for n in args.services:
        result = measure(n)
        nft_s, ipt_s = result["nft_f_seconds"], result["iptables_restore_seconds"]
        assert isinstance(nft_s, list) and isinstance(ipt_s, list)
        print(
            f"| {n:,} | {nft_s[1]:.2f} s ({result['nft_script_bytes'] / 1e6:.1f} MB) | "
            f"{ipt_s[1]:.2f} s ({result['iptables_script_bytes'] / 1e6:.1f} MB) |"
        )
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"floors-{n}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
