"""What one big Service costs the other changes on a node: the budget of one partial sync.

In a fresh network namespace, with the real kernel (nftables), an agent's Proxier holds N
small Services (one port, 10 endpoints each: bench/workload.py's shape) after its first full
sync. Then one Service with P ports and E endpoints arrives, and later goes away. For each
budget (unbounded: everything a change brings in one sync, as before the budget; and the
agent's default, kpx_agent.sync.budget.MAX_SYNC_COST), it reports:
- the longest single sync while the big Service goes in, and while it goes away: what a small
  change recorded meanwhile waits at most before its own sync starts;
- the syncs and the seconds until the big Service is all in the kernel, and all gone.

Usage: python3 bench/sync_budget.py [--services N] [--ports P] [--endpoints E]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.budget import MAX_SYNC_COST
from kpx_agent.sync.proxier import Proxier
from kpx_api.proxysettings import NamespaceOptOut
from scratch_netns import run_in_scratch_netns
from workload import SETTINGS

UNBOUNDED = 10**9


def service(name: str, ip: str, ports: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "bench", "name": name},
        "spec": {
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [
                {"name": f"p{i}", "port": 10000 + i, "protocol": "TCP"} for i in range(ports)
            ],
        },
    }


def slices(name: str, ports: int, endpoints: int, base: int) -> list[dict[str, Any]]:
    out = []
    for s in range(0, endpoints, 1000):
        out.append(
            {
                "metadata": {
                    "namespace": "bench",
                    "name": f"{name}-{s // 1000}",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [
                    {"name": f"p{i}", "port": 20000 + i, "protocol": "TCP"} for i in range(ports)
                ],
                "endpoints": [
                    {
                        "addresses": [f"10.{base}.{i // 250}.{i % 250 + 1}"],
                        "conditions": {"ready": True},
                    }
                    for i in range(s, min(s + 1000, endpoints))
                ],
            }
        )
    return out


def drain(proxier: Proxier) -> tuple[int, float, float]:
    """Sync until nothing is left: (syncs, the longest one, all of them) in seconds."""
    syncs, longest, start = 0, 0.0, time.monotonic()
    while True:
        t = time.monotonic()
        outcome = proxier.sync()
        if not outcome.ok:
            raise RuntimeError(outcome.error)
        syncs += 1
        longest = max(longest, time.monotonic() - t)
        if not proxier.has_deferred():
            return syncs, longest, time.monotonic() - start


def inner(n: int, ports: int, endpoints: int, budget: int) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    for i in range(n):
        name = f"svc-{i}"
        state.upsert(SERVICES, service(name, f"10.96.{i // 250}.{i % 250 + 1}", 1))
        for sl in slices(name, 1, 10, 244 + i % 2):
            state.upsert(SLICES, sl)
    backend = NftablesBackend(SETTINGS)
    proxier = Proxier(
        state, backend, "bench-node-0", NamespaceOptOut(), AgentMetrics(), backend.settings
    )
    proxier.delete_flows = lambda _filters: 0
    proxier.max_sync_cost = budget
    proxier.max_service_cost = max(ports * endpoints, 1)
    assert proxier.sync().full
    state.upsert(SERVICES, service("big", "10.97.0.1", ports))
    for sl in slices("big", ports, endpoints, 250):
        state.upsert(SLICES, sl)
    add = drain(proxier)
    state.delete(SERVICES, service("big", "10.97.0.1", ports))
    for sl in slices("big", ports, endpoints, 250):
        state.delete(SLICES, sl)
    remove = drain(proxier)
    backend.cleanup()
    print(
        f"RESULT {budget} {add[0]} {add[1]:.3f} {add[2]:.3f} {remove[0]} {remove[1]:.3f} "
        f"{remove[2]:.3f}",
        flush=True,
    )


def run(n: int, ports: int, endpoints: int, budget: int) -> list[str]:
    argv = [sys.executable, __file__, "--inner", "--services", str(n), "--ports", str(ports)]
    argv += ["--endpoints", str(endpoints), "--budget", str(budget)]
    out = run_in_scratch_netns("kpxbudget", argv)
    return next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--ports", type=int, default=50)
    parser.add_argument("--endpoints", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--inner", action="store_true")
    args = parser.parse_args()
    if args.inner:
        inner(args.services, args.ports, args.endpoints, args.budget)
        return
    print(
        f"{args.services} small Services, then one with {args.ports} ports x "
        f"{args.endpoints} endpoints, added then deleted (nftables, one netns)"
    )
    print(
        "| budget (endpoints per partial sync) | longest sync while it goes in (s) "
        "| syncs, seconds until all in | longest sync while it goes away (s) "
        "| syncs, seconds until all gone |"
    )
    print("|---|---:|---:|---:|---:|")
    for budget, label in (
        (UNBOUNDED, "unbounded (one sync)"),
        (MAX_SYNC_COST, f"{MAX_SYNC_COST:,}"),
    ):
        r = run(args.services, args.ports, args.endpoints, budget)
        print(f"| {label} | {r[2]} | {r[1]}, {r[3]} | {r[5]} | {r[4]}, {r[6]} |", flush=True)


if __name__ == "__main__":
    main()
