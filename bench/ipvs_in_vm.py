"""ipvs against the other modes in the same proxy-vm guest (the guest is emulated: compare the
ratios, not the absolute times).

    proxy-vm exec -- python3 bench/ipvs_in_vm.py --services 1000 [--modes ipvs,iptables,nftables]

Each mode runs in a fresh network namespace (the script re-executes itself there): a full sync
of N Services (bench/workload.py's: one TCP port, a cluster IP, 10 endpoints each), then 20
changes of one Service's endpoints (median). Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from kpx_agent import backends
from kpx_agent.model.types import NodeLocalState
from workload import SETTINGS, TARGET_PORT, node_local_state, service_port


def run_mode(mode: str, count: int) -> dict[str, Any]:
    module = backends.load(mode)
    backend = module.create(SETTINGS)
    state = node_local_state(count)
    node, ports, facts = state.node, dict(state.services), state.facts
    start = time.perf_counter()
    backend.sync(NodeLocalState(node, dict(ports), facts), None)
    full = time.perf_counter() - start
    changes = []
    for n in range(20):
        changed = service_port(n * 7 % count, target_port=TARGET_PORT + n + 1)
        ports[changed.key] = changed
        start = time.perf_counter()
        backend.sync(NodeLocalState(node, dict(ports), facts), [changed.key])
        changes.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "services": count,
        "full_sync_s": round(full, 3),
        "one_change_median_ms": round(statistics.median(changes) * 1000, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--modes", default="ipvs,iptables,nftables")
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile", action="store_true", help="print the costliest functions of each mode"
    )
    args = parser.parse_args()
    if args.in_netns:
        try:
            if args.profile:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                result = profiler.runcall(run_mode, args.modes, args.services)
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
            else:
                result = run_mode(args.modes, args.services)
            print(json.dumps(result), flush=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps({"mode": args.modes, "error": error}), flush=True)
        return 0
    for mode in args.modes.split(","):
        netns = f"kpxbench-{mode}"
        subprocess.run(["ip", "netns", "add", netns], check=True)
        # lo up: IPVS refuses real servers (EINVAL) in a netns without any local address
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        try:
            argv = [sys.executable, __file__, "--in-netns", "--modes", mode]
            argv += ["--services", str(args.services)] + (["--profile"] if args.profile else [])
            subprocess.run(["ip", "netns", "exec", netns, *argv], check=False)
        finally:
            subprocess.run(["ip", "netns", "del", netns], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
