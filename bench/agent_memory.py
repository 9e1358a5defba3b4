"""The kpx nftables agent's memory at N Services, a relist included.

Against ONE local control plane, for each size N (default 1,000, 10,000, 30,000; the
workload of bench/workload.py grows from one size to the next: N ClusterIP Services and N
EndpointSlices of 10 endpoints), the agent is started alone in a fresh node netns:

1. cold start: process start -> the kernel holds all N Services (bench/kernel_probe.py);
   peak RSS (VmHWM) and RSS then;
2. a relist: one ConfigMap written (etcd's revision moves past every resourceVersion the
   agent's watches hold), etcd compacted to its head, the apiserver restarted (its watch
   cache starts again from etcd's head): the agent's watches get 410 Gone and it lists every
   Service and EndpointSlice again (seen in its log), while it holds the first copy;
3. after the relist has settled: peak RSS (VmHWM) and RSS.

Then the slopes: peak RSS per Service (x 10 endpoints) between the sizes, least squares.
Memory figures do not depend on the machine's load; the cold-start times beside them do.

With --agent LABEL=DIR[,VAR=VALUE...] (repeatable) each size measures the agent of the source
tree DIR (its api/, kube/ and agents/ on PYTHONPATH) with those environment variables, one after the
other (before and after a change, side by side); by default the agent of this tree.

Usage: python3 bench/agent_memory.py [--services 1000,10000,30000] [--agent LABEL=DIR,...]
       [--no-write]
Writes bench/results/agent_memory.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchlib import (
    ApiClient,
    bench_cluster,
    exit_on_sigterm,
    log,
    machine_info,
    proc_memory_kb,
    write_json,
)
from compare import (
    KPX,
    WORKERS,
    Dataplane,
    Running,
    measuring,
    start,
    wait_cold_start,
)
from kpx_cluster.controlplane import Cluster
from workload import ENDPOINTS_PER_SERVICE, Workload, create_node, grow

RELIST_TIMEOUT = 300.0
GONE_LINE = "watch expired (410 Gone)"
RELISTED_LINE = "listed "  # the reflector's debug line after each list (-v)


ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Agent:
    label: str
    tree: Path
    env: Mapping[str, str]

    @classmethod
    def parse(cls, text: str) -> Agent:
        label, _, rest = text.partition("=")
        tree, *pairs = rest.split(",")
        env = dict(p.split("=", 1) for p in pairs)
        return cls(label, Path(tree or ROOT).resolve(), env)

    def prefix(self) -> list[str]:
        path = ":".join(
            str(self.tree / d) for d in ("api", "kube", "agents", "operator", "harness")
        )
        return ["env", f"PYTHONPATH={path}", *(f"{k}={v}" for k, v in self.env.items())]


@dataclass
class Size:
    agent: str
    services: int
    cold_s: float = 0.0  # timing: depends on the machine's load
    cold_peak_mb: float = 0.0
    cold_rss_mb: float = 0.0
    relisted: list[str] = field(default_factory=list)  # the resources listed again
    relist_s: float = 0.0
    peak_mb: float = 0.0  # VmHWM after the relist: the agent's peak
    rss_mb: float = 0.0  # VmRSS after the relist
    error: str = ""


def _mem(run: Running) -> tuple[float, float]:
    mem = proc_memory_kb(run.pid)
    return mem.get("VmHWM", 0) / 1024, mem.get("VmRSS", 0) / 1024


def _lines(run: Running, needle: str) -> list[str]:
    try:
        text = run.log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if needle in line]


def force_relist(cluster: Cluster, api: ApiClient, run: Running) -> tuple[list[str], float]:
    """Make the agent's watches resume from a compacted resourceVersion (410 Gone): it lists
    everything again. Returns the resources listed again and the seconds it took."""
    listed_before = len(_lines(run, RELISTED_LINE))
    api.request(
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"metadata": {"generateName": "kpx-bench-relist-"}, "data": {"k": "v"}},
    )
    started = time.monotonic()
    argv = cluster.stop_component("kube-apiserver")
    try:
        cluster.compact_etcd()
    finally:
        cluster.start_component("kube-apiserver", argv)
    while time.monotonic() - started < RELIST_TIMEOUT:
        run.check_alive()
        listed = _lines(run, RELISTED_LINE)[listed_before:]
        kinds = sorted({w for line in listed for w in ("services", "endpointslices") if w in line})
        if len(kinds) == 2:
            return kinds, time.monotonic() - started
        time.sleep(0.5)
    raise RuntimeError(f"no relist of services and endpointslices in {RELIST_TIMEOUT:.0f} s")


class AgentDataplane(Dataplane):
    """The kpx agent of one source tree (`Agent`), in nftables mode unless told."""

    def __init__(self, agent: Agent, mode: str = "nftables") -> None:
        super().__init__(KPX, mode)
        object.__setattr__(self, "agent", agent)

    def argv(self, kubeconfig: Path, agent_args: Sequence[str] = ()) -> list[str]:
        agent: Agent = self.agent  # type: ignore[attr-defined]
        return [*agent.prefix(), *super().argv(kubeconfig, agent_args)]

    def source_tree(self) -> Path | None:
        agent: Agent = self.agent  # type: ignore[attr-defined]
        return agent.tree


def measure(agent: Agent, n: int, cluster: Cluster, api: ApiClient, work: Workload) -> Size:
    out = Size(agent.label, n)
    dp = AgentDataplane(agent)

    def fail(error: str) -> None:
        out.error = error

    with measuring(cluster, f"{agent.label} {n:,}", fail) as session:
        topo, node, probe = session.topo, session.node, session.probe
        tag = f"kpx-memory-{agent.label}-{n}"
        run = session.run = start(dp, topo, node, cluster, tag, ("-v",))
        cold, _ = wait_cold_start(dp, probe, run, topo, node, work, 600.0)
        out.cold_s = round(cold.seconds, 2)
        time.sleep(3.0)  # the first sync's verification and the freeze
        out.cold_peak_mb, out.cold_rss_mb = _mem(run)
        log(
            f"{agent.label} {n:,}: cold start {cold.seconds:.2f} s (timing under load); peak "
            f"{out.cold_peak_mb:.0f} MB, RSS {out.cold_rss_mb:.0f} MB"
        )
        gone_before = len(_lines(run, GONE_LINE))
        out.relisted, took = force_relist(cluster, api, run)
        out.relist_s = round(took, 2)
        gone = len(_lines(run, GONE_LINE)) - gone_before
        time.sleep(8.0)  # the relist's sync (nothing changed) and a settled heap
        out.peak_mb, out.rss_mb = _mem(run)
        log(
            f"{agent.label} {n:,}: relisted {out.relisted} ({gone} x 410 Gone) in "
            f"{took:.1f} s; peak {out.peak_mb:.0f} MB, RSS {out.rss_mb:.0f} MB"
        )
    return out


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through (x, y): (slope, intercept)."""
    k = len(points)
    mx = sum(x for x, _ in points) / k
    my = sum(y for _, y in points) / k
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return b, my - b * mx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", default="1000,10000,30000", help="comma-separated sizes")
    parser.add_argument(
        "--agent", action="append", default=[], help="LABEL=DIR[,VAR=VALUE...] (repeatable)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    agents = [Agent.parse(a) for a in args.agent] or [Agent("kpx", ROOT, {})]
    sizes = sorted(int(s) for s in args.services.split(","))
    exit_on_sigterm()
    results: list[Size] = []
    work = Workload()
    with bench_cluster("bench-mem") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            create_node(api, work)
            for n in sizes:
                log(f"=== {n:,} Services x {ENDPOINTS_PER_SERVICE} endpoints")
                grow(cluster, api, work, n)
                work.settle_node()
                results += [measure(agent, n, cluster, api, work) for agent in agents]
        finally:
            api.close()
    slopes: dict[str, tuple[float, float]] = {}
    for agent in agents:
        ok = [r for r in results if r.agent == agent.label and not r.error and r.peak_mb]
        for r in ok:
            log(
                f"{agent.label} {r.services:>6,} Services: cold peak {r.cold_peak_mb:.0f} MB, "
                f"after a relist peak {r.peak_mb:.0f} MB, RSS {r.rss_mb:.0f} MB"
            )
        if len(ok) > 1:
            slopes[agent.label] = slope([(r.services, r.peak_mb) for r in ok])
            b, a = slopes[agent.label]
            log(
                f"{agent.label} slope: {b * 1024:.1f} kB per Service with "
                f"{ENDPOINTS_PER_SERVICE} endpoints (intercept {a:.0f} MB)"
            )
    if not args.no_write:
        path = write_json(
            "agent_memory.json",
            {
                "machine": machine_info(),
                "endpoints_per_service": ENDPOINTS_PER_SERVICE,
                "agents": {a.label: {"tree": str(a.tree), "env": dict(a.env)} for a in agents},
                "sizes": [asdict(r) for r in results],
                "slopes_mb_per_service": {k: v[0] for k, v in slopes.items()},
                "intercepts_mb": {k: v[1] for k, v in slopes.items()},
            },
        )
        log(f"wrote {path}")
    return 0 if all(not r.error for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
