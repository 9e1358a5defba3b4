"""The fault table (issue #22): faults injected under load on three real kubelet nodes.

    python3 bench/chaos.py [--scale 1.0] [--only NAME ...] [--simulator] [--out PATH]

A fresh local control plane and three real nodes (a kubelet and containerd each,
`kpx_cluster.migration_real`); kpx installed from its manifests in mode nftables (the operator
and the agents from the built images: `make image`), the backends (real pods) and Services of
`kpx_cluster.migration`. `--simulator`: the same on three nodes of the node simulator. For each
row (`kpx_cluster.chaos`): the load client on every node (new TCP connections and UDP exchanges
to the ClusterIPs and the NodePort on every node, held connections), the fault injected, a
Service created while it holds (or at its heal when the fault takes the apiserver away), the
fault healed, then the seconds until every change and the base Services answer from every node.
Prints the table and writes bench/results/chaos.md. `--scale` multiplies the faults' durations
(development: 0.2). Exit status 1 when a row misses its goal (docs/chaos.md). The rows that
need iptables mode (a foreign `iptables -F`) run last, after spec.mode is switched to iptables
under no load.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import bench_cluster, exit_on_sigterm, log
from kpx_cluster.chaos import faults as f
from kpx_cluster.chaos.runner import Fault, NotBuilt, Options, run_row
from kpx_cluster.chaos.table import RowResult, details, exit_status, render
from kpx_cluster.migration import LoadOptions, MigrationEnv, migration_cluster, wait_rolled_out
from kpx_cluster.migration_real import real_migration_cluster

RESULTS = Path(__file__).resolve().parent / "results"


def rows() -> list[Fault | NotBuilt]:
    return [
        f.AgentKill("one"),
        f.AgentKill("all"),
        f.AgentKill("one", times=5),
        f.ApiserverDown(60),
        f.NftFlush(),
        f.NftElementDeleted(),
        f.PoisonPair(),
        f.CompactionBurst(60),
        f.ApiserverDropped(60),
        f.OptOutFlap(30),
        f.OperatorLeader("kill"),
        f.OperatorLeader("stop", 30),
        f.ObjectBomb(2000, 50),
        f.NodeReboot(),
        f.PxcDeleted(10),
        f.IptablesFlush(),
    ]


#: the modes the rows run in, in order (the suite starts in the first)
MODES = ("nftables", "iptables")


def row_mode(row: Fault | NotBuilt) -> str:
    return (row.mode if isinstance(row, Fault) else None) or MODES[0]


def switch_mode(env: MigrationEnv, old: str, new: str) -> None:
    """spec.mode `old` -> `new`, and wait until every node runs `new` with no `old` rules."""
    log(f"== switching kpx from {old} to {new} for the rows that need it")
    env.patch_mode(old, new)
    took = wait_rolled_out(env, old, new, time.monotonic(), f"after the switch to {new}", 300, log)
    if took is None:
        raise RuntimeError(f"kpx did not roll out in {new} within 300 s")


def report(results: list[RowResult], opts: Options, nodes: int, seconds: float, real: bool) -> str:
    lo = opts.load
    what = (
        "real kubelet nodes (a kubelet and containerd each, the backends as real pods)"
        if real
        else "simulated nodes"
    )
    problems = details(results)
    return "\n".join(
        [
            "# Fault table (bench/chaos.py, `make chaos`)",
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {nodes} "
            f"{what}, kpx in nftables mode (the iptables rows: after a switch to iptables "
            f"mode), operator and agents from the images; faults' durations "
            f"x{opts.scale:g}; {seconds / 60:.0f} min in all.",
            f"Load per node: a new TCP connection every {lo.interval * 1000:.0f} ms and a UDP "
            f"exchange every {lo.udp_interval * 1000:.0f} ms, over 2 ClusterIPs, a NodePort's "
            f"ClusterIP and the NodePort on every node's address; {lo.holds} held connections. "
            f"A try fails without an answer within {lo.timeout:.0f} s. 'touched': tries from a "
            "client on a node the fault touches or to a NodePort on such a node. Converged: "
            "seconds from the heal until the Services created during the fault and the base "
            "Services answer from every node (docs/chaos.md).",
            "",
            render(results),
            "",
            "Notes:" if problems else "No notes.",
            *problems,
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only the rows whose name contains this (repeatable)",
    )
    parser.add_argument("--converge-timeout", type=float, default=180.0)
    parser.add_argument(
        "--simulator", action="store_true", help="on the node simulator, not real kubelets"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out = args.out or RESULTS / ("chaos-simulator.md" if args.simulator else "chaos.md")
    opts = Options(load=LoadOptions(), scale=args.scale, converge_timeout=args.converge_timeout)
    selected = [r for r in rows() if not args.only or any(o in r.name for o in args.only)]
    exit_on_sigterm()
    results: list[RowResult] = []
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.simulator:
            cluster = stack.enter_context(bench_cluster("bench-chaos"))
            env = stack.enter_context(migration_cluster(cluster, "nftables", args.nodes, log=log))
        else:
            env = stack.enter_context(real_migration_cluster("nftables", args.nodes, log=log))
        exit_on_sigterm()  # the Topology installed its own handlers
        for mode in MODES:
            group = [r for r in selected if row_mode(r) == mode]
            if not group:
                continue
            if mode != opts.mode:
                switch_mode(env, opts.mode, mode)
                opts.mode = mode
            for fault in group:
                results.append(run_row(env, fault, opts, log))
                log(render(results[-1:]).splitlines()[-1])
    text = report(results, opts, args.nodes, time.monotonic() - t0, not args.simulator)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
