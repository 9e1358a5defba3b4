"""ProxyNodeState writes at scale: 1,000 simulated agents against a real apiserver.

Every simulated node runs the agent's real writer
(kpx_agent.observability.node_state_writer.NodeStateWriter with its WriteGate, the code the
agent runs) in one process, all through one HTTPS client (`--connections` in flight) to a fresh
local control plane with the ProxyNodeState CRD. Each node's facts change as a real agent's do,
on sync events that come to every node (each agent programs every Service): a cluster-wide
change every `--change-period` seconds reaches each node after its own delay (0-500 ms, as the
agents' watches and minSyncPeriod spread them), and each node then records a sync (new time and
duration) and pokes its writer. Scenarios, `--seconds` each (after a warm-up that creates the
objects):

1. quiet: syncs with no change of what the status shows (an endpoint replaced by another: the
   counts stay): only the sync time changes, which is no news: no write is expected;
2. churn: every change moves the endpoint count (a Deployment scaling up and down): each node
   wants to write on every change, the gate allows one write per node per `--period`;
3. errors: as churn, and every node's sync fails every other time with a new error message.

For each: the sync events per second, the writes per second the gate let through (counted by
the writers: successful creates and status patches), the bound (nodes / period), the writes
that failed, the apiserver's CPU. Usage:

    python3 bench/node_state.py [--nodes 1000] [--period 10] [--seconds 60]

Writes bench/results/node_state-<nodes>.json and bench/results/node_state.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for sub in ("agents", "kube", "api", "harness"):
    sys.path.insert(0, str(REPO / sub))

from benchlib import (  # noqa: E402
    bench_cluster,
    component_pid,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    proc_cpu_seconds,
    write_json,
)
from kpx_agent.observability.node_state import ErrorRecord, NodeFacts, SyncRecord  # noqa: E402
from kpx_agent.observability.node_state_writer import NodeStateWriter  # noqa: E402
from kpx_kube import Client, from_kubeconfig  # noqa: E402

RESULTS = REPO / "bench" / "results"
CRD = REPO / "crds" / "proxynodestates.proxy.kpx.dev.yaml"
SPREAD = 0.5  # seconds over which one change reaches the nodes


@dataclass
class SimNode:
    """One simulated agent: its facts and its real writer."""

    name: str
    facts: NodeFacts
    writer: NodeStateWriter | None = None
    syncs: int = 0
    written_at: list[float] = field(default_factory=list)  # monotonic time of each write

    def attach(self, writer: NodeStateWriter) -> None:
        """Use `writer`, noting the time of each of its writes (its gate's `wrote`)."""
        self.writer = writer
        wrote = writer.gate.wrote

        def noted(status: Any, now: float) -> None:
            if status:  # a failed write notes {}
                self.written_at.append(now)
            wrote(status, now)

        writer.gate.wrote = noted  # type: ignore[method-assign]

    def sync(self, endpoints: int, error: str) -> None:
        now = datetime.now(UTC)
        if error:
            self.facts = replace(self.facts, last_error=ErrorRecord(error, now))
        else:
            duration = random.uniform(0.005, 0.05)
            self.facts = replace(
                self.facts, endpoints=endpoints, last_sync=SyncRecord(now, duration, False)
            )
        self.syncs += 1
        assert self.writer is not None
        self.writer.poke()


async def scenario(
    nodes: list[SimNode], name: str, seconds: float, change_period: float, apiserver: int | None
) -> dict[str, Any]:
    """Drive cluster-wide changes for `seconds`; the writers' counts over that window."""
    loop = asyncio.get_running_loop()
    writes0 = sum(n.writer.writes for n in nodes if n.writer)
    failed0 = sum(n.writer.failures for n in nodes if n.writer)
    syncs0 = sum(n.syncs for n in nodes)
    cpu0 = sum(proc_cpu_seconds(apiserver)) if apiserver else 0.0
    started = time.monotonic()
    round_ = 0
    endpoints = 3000
    while time.monotonic() - started < seconds:
        round_ += 1
        error = ""
        if name == "churn" or name == "errors":
            endpoints += 1 if round_ % 2 else -1
        if name == "errors" and round_ % 2:
            error = f"mode nftables: Error: Could not process rule: round {round_}"
        for node in nodes:
            loop.call_later(random.uniform(0, SPREAD), node.sync, endpoints, error)
        await asyncio.sleep(change_period)
    elapsed = time.monotonic() - started
    ended = time.monotonic()
    gaps = [
        b - a
        for n in nodes
        for a, b in zip(n.written_at, n.written_at[1:], strict=False)
        if a >= started and b <= ended
    ]
    most = max(sum(1 for t in n.written_at if started <= t <= ended) for n in nodes)
    writes = sum(n.writer.writes for n in nodes if n.writer) - writes0
    failed = sum(n.writer.failures for n in nodes if n.writer) - failed0
    syncs = sum(n.syncs for n in nodes) - syncs0
    cpu = (sum(proc_cpu_seconds(apiserver)) - cpu0) if apiserver else float("nan")
    return {
        "scenario": name,
        "seconds": round(elapsed, 1),
        "syncs_per_s": round(syncs / elapsed, 1),
        "writes": writes,
        "writes_per_s": round(writes / elapsed, 2),
        "failed": failed,
        "apiserver_cpu_s_per_s": round(cpu / elapsed, 3),
        "min_gap_s": round(min(gaps), 2) if gaps else None,
        "most_writes_of_one_node": most,
    }


async def run(args: argparse.Namespace, kubeconfig: Path, apiserver: int | None) -> dict[str, Any]:
    client = Client(
        from_kubeconfig(kubeconfig), user_agent="kpx-bench-node-state", connections=args.connections
    )
    base = NodeFacts(
        mode="nftables",
        agent_version="0.1.0",
        generation=1,
        verified=True,
        services=1000,
        endpoints=3000,
        rules=9000,
    )
    nodes = [
        SimNode(f"sim-{i:04d}", replace(base, pod=(f"kpx-agent-{i}", "kpx-system", f"uid-{i}")))
        for i in range(args.nodes)
    ]
    for node in nodes:
        node.attach(
            NodeStateWriter(client, node.name, (lambda n=node: n.facts), interval=args.period)
        )
    tasks = [asyncio.create_task(n.writer.run()) for n in nodes if n.writer]
    try:
        # Warm-up: every node creates its object and writes its first status.
        t0 = time.monotonic()
        for node in nodes:
            node.sync(3000, "")
        while sum(1 for n in nodes if n.writer and n.writer.writes) < len(nodes):
            if time.monotonic() - t0 > 300:
                raise RuntimeError("the warm-up did not finish in 300 s")
            await asyncio.sleep(0.5)
        warmup = time.monotonic() - t0
        log(f"{len(nodes)} objects created and written in {warmup:.1f}s")
        await asyncio.sleep(args.period)  # every gate's interval over
        rows = []
        for name in ("quiet", "churn", "errors"):
            row = await scenario(nodes, name, args.seconds, args.change_period, apiserver)
            log(f"{name}: {row}")
            rows.append(row)
        return {"warmup_seconds": round(warmup, 1), "rows": rows}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--period", type=float, default=10.0, help="the writers' interval (s)")
    p.add_argument("--seconds", type=float, default=60.0, help="each scenario's length (s)")
    p.add_argument(
        "--change-period",
        type=float,
        default=1.0,
        help="seconds between cluster-wide changes (reaching all nodes)",
    )
    p.add_argument("--connections", type=int, default=32)
    args = p.parse_args()
    exit_on_sigterm()
    info = machine_info()
    with bench_cluster("nodestate") as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(CRD))
        cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/proxynodestates.proxy.kpx.dev",
        )
        apiserver = component_pid(cluster, "kube-apiserver")
        result = asyncio.run(run(args, cluster.kubeconfig, apiserver))
    bound = args.nodes / args.period
    # In a window of T s one node writes at most floor(T / period) + 1 times.
    window = {
        r["scenario"]: args.nodes * (int(r["seconds"] // args.period) + 1) / r["seconds"]
        for r in result["rows"]
    }
    data = {
        "machine": info,
        "nodes": args.nodes,
        "period": args.period,
        "change_period": args.change_period,
        "bound_writes_per_s": bound,
        **result,
    }
    write_json(f"node_state-{args.nodes}.json", data)
    table = markdown_table(
        [
            "scenario",
            "sync events/s",
            "writes/s",
            "bound: nodes/period",
            "bound in this window",
            "min s between 2 writes of a node",
            "most writes of a node",
            "failed writes",
            "apiserver CPU (cores)",
        ],
        [
            (
                r["scenario"],
                r["syncs_per_s"],
                r["writes_per_s"],
                f"{bound:g}",
                f"{window[r['scenario']]:.1f}",
                r["min_gap_s"] if r["min_gap_s"] is not None else "-",
                r["most_writes_of_one_node"],
                r["failed"],
                r["apiserver_cpu_s_per_s"],
            )
            for r in result["rows"]
        ],
    )
    text = (
        f"## ProxyNodeState writes, {args.nodes:,} simulated nodes, period {args.period:g} s\n\n"
        f"Machine: {machine_line(info)}\n\n"
        f"`python3 bench/node_state.py --nodes {args.nodes} --period {args.period:g} "
        f"--seconds {args.seconds:g}`: the agent's writer and WriteGate for every node in one "
        f"process, one HTTPS client with {args.connections} connections, a fresh local "
        f"control plane. A cluster-wide change every {args.change_period:g} s reaches every "
        f"node within {SPREAD:g} s; each scenario runs {args.seconds:g} s. Warm-up (create "
        f"and first status of every object): {result['warmup_seconds']} s. The bound in a "
        f"window of T s: nodes x (floor(T / period) + 1) / T (a node may write at the start "
        f"and the end of it); over a long run it tends to nodes / period.\n\n" + table
    )
    (RESULTS / "node_state.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
