"""Cold starts of kpx agents side by side: the agents of several source trees started in turn
(A, B, A, B, ...) against ONE local control plane, each in a fresh node netns, so that the
machine's drift over the run weighs on each alike (before and after a change).

For N Services (bench/workload.py's: N ClusterIP Services x 10 endpoints), each start is timed
as compare.py times a cold start: process start -> the kernel holds all N Services
(bench/kernel_probe.py). With it: the process's CPU at that moment (its own and its children's,
such as nft or iptables-restore), and the phases of its `-v` log: process start -> its first
line (the interpreter and the imports), -> initial lists done, then the first full sync's
model and kernel parts.

Usage: python3 bench/cold_start.py [--services N] [--mode nftables|iptables] [--starts K]
       [--agent LABEL=DIR[,VAR=VALUE...]] ...   (repeatable; default: this tree)
       [--keep-logs DIR]   (each start's -v log copied there)
Prints each start and a table of medians (min-max); writes nothing else.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agent_memory import ROOT, Agent, AgentDataplane
from benchlib import (
    ApiClient,
    bench_cluster,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    proc_cpu_seconds,
    wait_until_quiet,
)
from compare import WORKERS, measuring, start, wait_cold_start
from kpx_cluster.controlplane import Cluster
from workload import ENDPOINTS_PER_SERVICE, Workload, create_node, grow

COLD_TIMEOUT = 300.0
_SYNC_RE = re.compile(
    r"full sync of \d+ service ports: [0-9.]+ s \(model ([0-9.]+) s, kernel ([0-9.]+) s\)"
)


@dataclass
class Start:
    agent: str
    seconds: float = 0.0  # process start -> all N Services in the kernel
    cpu: float = 0.0  # own + children's CPU seconds then
    first_line: float = 0.0  # process start -> its first log line
    lists_done: float = 0.0  # process start -> initial lists done
    model: float = 0.0  # the first full sync's model part
    kernel: float = 0.0  # and its kernel part
    error: str = ""


def one_start(
    agent: Agent, mode: str, cluster: Cluster, work: Workload, index: int, logs: Path | None
) -> Start:
    out = Start(agent.label)
    dp = AgentDataplane(agent, mode)

    def fail(error: str) -> None:
        out.error = error

    with measuring(cluster, f"{agent.label} #{index}", fail) as session:
        tag = f"kpx-cold-{agent.label}-{index}"
        run = session.run = start(dp, session.topo, session.node, cluster, tag, ("-v",))
        cold, _ = wait_cold_start(
            dp, session.probe, run, session.topo, session.node, work, COLD_TIMEOUT
        )
        if cold.timed_out:
            raise TimeoutError(f"no cold start in {COLD_TIMEOUT:.0f} s")
        own, children = proc_cpu_seconds(run.pid)
        out.seconds, out.cpu = cold.seconds, own + children
        deadline = time.monotonic() + 30.0
        while (found := _SYNC_RE.search(run.log_path.read_text(errors="replace"))) is None:
            run.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("no full sync line in the agent's log")
            time.sleep(0.2)
        out.model, out.kernel = float(found[1]), float(found[2])
        out.first_line = run.log_time(" starting in mode ") or 0.0
        out.lists_done = run.log_time("initial lists done") or 0.0
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run.log_path, logs / run.log_path.name)
        log(
            f"{agent.label} #{index}: cold start {out.seconds:.2f} s, CPU {out.cpu:.2f} s; "
            f"first line {out.first_line:.2f} s, lists done {out.lists_done:.2f} s, "
            f"model {out.model:.3f} s, kernel {out.kernel:.3f} s"
        )
    return out


def _spread(values: list[float]) -> str:
    """Median (min-max) in seconds."""
    if not values:
        return "n/a"
    return f"{median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--mode", default="nftables", choices=("nftables", "iptables"))
    parser.add_argument("--starts", type=int, default=5, help="cold starts per agent")
    parser.add_argument(
        "--agent", action="append", default=[], help="LABEL=DIR[,VAR=VALUE...] (repeatable)"
    )
    parser.add_argument(
        "--keep-logs", type=Path, metavar="DIR", help="copy each start's -v log into DIR"
    )
    args = parser.parse_args()
    agents = [Agent.parse(a) for a in args.agent] or [Agent("kpx", ROOT, {})]
    exit_on_sigterm()
    work = Workload()
    starts: list[Start] = []
    with bench_cluster("bench-cold") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            create_node(api, work)
            grow(cluster, api, work, args.services)
            work.settle_node()
        finally:
            api.close()
        for index in range(args.starts):
            for agent in agents:
                wait_until_quiet()
                starts.append(one_start(agent, args.mode, cluster, work, index, args.keep_logs))
    rows = []
    for agent in agents:
        ok = [s for s in starts if s.agent == agent.label and not s.error]
        rows.append(
            (
                agent.label,
                f"{len(ok)} of {args.starts}",
                _spread([s.seconds for s in ok]),
                _spread([s.cpu for s in ok]),
                _spread([s.first_line for s in ok]),
                _spread([s.lists_done - s.first_line for s in ok]),
                _spread([s.model for s in ok]),
                _spread([s.kernel for s in ok]),
            )
        )
    print(
        f"\n{args.services:,} Services x {ENDPOINTS_PER_SERVICE} endpoints, {args.mode}, "
        f"agents started in turn; median (min-max). {machine_line(machine_info())}\n"
    )
    print(
        markdown_table(
            (
                "agent",
                "starts",
                "cold start",
                "CPU then",
                "start -> first log line",
                "first log line -> initial lists done",
                "model",
                "kernel",
            ),
            rows,
        )
    )
    return 0 if all(not s.error for s in starts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
