"""The floor under each mode's cold start: the tool alone loading the agent's own ruleset.

For N Services x 10 endpoints (bench/workload.py's, as the node-local state built in-process, no
control plane), the
agent's backends render their full-sync transactions exactly as they would at start; then, in
a fresh network namespace each, the timed load is `nft -f` of the nftables transaction, and
`iptables-restore --noflush` / `ip6tables-restore --noflush` of the iptables scripts, in the
order the backend applies them. Compare with the agents' cold starts from `make bench`
(bench/results/compare-<N>.md): the difference is what the agent adds on top of the kernel.

Usage: python3 bench/floors.py [--services N ...]    (default: 1000 10000)
Each load is reported with its CPU: the tool's own (user) and the kernel's (system: nf_tables
runs a transaction inside the tool's netlink calls).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time
import uuid
from dataclasses import dataclass
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


@dataclass(frozen=True, order=True)
class Timed:
    seconds: float  # wall clock
    user: float  # the tool's CPU in user space
    system: float  # and in the kernel: nf_tables running the transaction happens here


def timed_in_fresh_netns(loads: list[tuple[list[str], str]]) -> Timed:
    """Time to run each (argv, stdin) in order inside a new, empty network namespace, with
    the CPU it took."""
    ns = f"kpxfloor{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        for argv, stdin in loads:
            subprocess.run(
                ["ip", "netns", "exec", ns, *argv],
                input=stdin,
                text=True,
                check=True,
                capture_output=True,
            )
        took = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return Timed(took, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def measure(n: int, runs: int = 3) -> dict[str, object]:
    st = node_local_state(n)
    nft = nft_script(st)
    ipt = iptables_scripts(st)
    nft_t = sorted(timed_in_fresh_netns([(["nft", "-f", "-"], nft)]) for _ in range(runs))
    ipt_loads = [([RESTORE[fam], "--noflush"], script) for fam, script in ipt]
    ipt_t = sorted(timed_in_fresh_netns(ipt_loads) for _ in range(runs))
    return {
        "services": n,
        "nft_f_seconds": [t.seconds for t in nft_t],
        "nft_f_user_system_seconds": [[t.user, t.system] for t in nft_t],
        "nft_script_bytes": len(nft.encode()),
        "iptables_restore_seconds": [t.seconds for t in ipt_t],
        "iptables_restore_user_system_seconds": [[t.user, t.system] for t in ipt_t],
        "iptables_script_bytes": sum(len(s.encode()) for _, s in ipt),
    }


def _cpu(result: dict[str, object], key: str) -> str:
    """The median run's CPU: user space and kernel."""
    runs = result[key]
    assert isinstance(runs, list)
    user, system = runs[len(runs) // 2]
    return f"user {user:.2f} s, kernel {system:.2f} s"


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
        nft_b, ipt_b = result["nft_script_bytes"], result["iptables_script_bytes"]
        assert isinstance(nft_s, list) and isinstance(ipt_s, list)
        assert isinstance(nft_b, int) and isinstance(ipt_b, int)
        print(
            f"| {n:,} | {nft_s[len(nft_s) // 2]:.2f} s ({nft_b / 1e6:.1f} MB;"
            f" {_cpu(result, 'nft_f_user_system_seconds')}) | "
            f"{ipt_s[len(ipt_s) // 2]:.2f} s ({ipt_b / 1e6:.1f} MB;"
            f" {_cpu(result, 'iptables_restore_user_system_seconds')}) |"
        )
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"floors-{n}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
