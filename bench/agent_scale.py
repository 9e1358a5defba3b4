"""How the nftables agent scales with the number of Services, observed in the kernel.

For each size N (default 1,000 and 10,000), against a fresh local control plane:

1. create the workload: N ClusterIP Services (one TCP port) and N EndpointSlices of 10 ready
   endpoints (made-up pod IPs in 10.244.0.0/16, nodeName spread over 4 nodes), in bulk;
2. start `proxy-agent --mode nftables` in a node network namespace and time, from the process
   start, until the kernel's `service-ips` map holds all N VIPs (its elements counted over
   netlink every few milliseconds, then confirmed with `nft list map`);
3. change one endpoint address of one EndpointSlice at a time (20 times by default, spaced
   beyond the agent's minSyncPeriod) and time until the kernel's `endpoints` map holds the new
   address instead of the old one in that VIP's buckets (netlink lookups of those 10
   elements, as `nft get element` does but without its cache load of every element, 1 s at
   100,000; each result is then cross-checked with `nft get element`);
4. update the agent's Node status 50 times (a heartbeat: its Ready condition's times and
   message; spaced like the changes) and report what they cost the agent (CPU, its own and of
   its `nft` children; syncs and kernel programming from its metrics) beside what the single
   changes cost;
5. read the agent's peak RSS (VmHWM) and CPU seconds from /proc.

The workload is bench/workload.py's (the same as bench/compare.py's); the kernel is read with
bench/kernel_probe.py. The floor under the cold start (`nft -f` of the same ruleset) is
bench/floors.py's.

Usage: python3 bench/agent_scale.py [--services N] [--changes 20]
Writes bench/results/agent_scale-<N>.json and its section of bench/results/latest.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchlib import (
    ApiClient,
    LineHelper,
    bench_cluster,
    component_pid,
    endpoints,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    percentile,
    pids_with_env,
    proc_cpu_seconds,
    proc_memory_kb,
    slices_path,
    update_latest,
    write_json,
)
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import ENV_MARK, Node, Topology
from workload import (
    CLUSTER_CIDR,
    CREATE_CHUNK,
    ENDPOINTS_PER_SERVICE,
    NAMESPACE,
    NODE_NAME,
    NODE_SETTLE_SECONDS,
    SERVICE_PORT,
    TARGET_PORT,
    Workload,
    changed_address,
    create_node,
    endpoint_addresses,
    grow,
    svc_name,
)

METRICS_ADDRESS = "127.0.0.1:10249"
WORKERS = 8  # concurrent requests while creating
COLD_START_TIMEOUT = 900.0
PROBE_HELPER = Path(__file__).resolve().parent / "kernel_probe.py"
CHANGE_TIMEOUT = 60.0
COLD_POLL_INTERVAL = 0.005
CHANGE_POLL_INTERVAL = 0.0005
SETTLE_SECONDS = 3.0
DEFAULT_SIZES = (1000, 10000)

GOALS = {"cold_start_s": 3.0, "cold_start_at": 10000, "change_median_ms": 50.0}
# Upstream kube-proxy v1.36.2, mode nftables, measured on this machine in kind.
UPSTREAM = {
    1000: {"start_s": "0.9", "change_ms": "288", "rss_mb": "88-115"},
    10000: {"start_s": "12.7", "change_ms": "3,900", "rss_mb": "296-429"},
}
_VIP_RE = re.compile(rf"(\d+\.\d+\.\d+\.\d+) \. tcp \. {SERVICE_PORT} : goto")
_LOG_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


# ---- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    changes: int = 20
    gap: float = 1.2
    node_updates: int = 50
    cold_starts: int = 3  # agent starts into an empty kernel; the last one goes on to changes
    agent_args: tuple[str, ...] = ()  # extra agent flags, e.g. -v
    keep_log: Path | None = None  # copy the agent's log here
    write: bool = True  # write bench/results


@dataclass
class Creation:
    services_s: float = 0.0
    slices_s: float = 0.0
    node_created: float = 0.0  # monotonic clock
    service_chunks_s: list[float] = field(default_factory=list)  # per CREATE_CHUNK Services
    control_plane_cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.services_s + self.slices_s


def create_workload(cluster: Cluster, api: ApiClient, n: int) -> tuple[list[str], Creation]:
    """The shared workload (bench/workload.py) at size N: the VIPs, and what creating took."""
    work = Workload()
    create_node(api, work)
    grow(cluster, api, work, n)
    made = work.creation[-1]
    creation = Creation(
        services_s=made["services_s"],
        slices_s=made["slices_s"],
        node_created=work.node_created,
        service_chunks_s=made["service_chunks_s"],
        control_plane_cpu_s=made["control_plane_cpu_s"],
    )
    return work.vips, creation


# ---- the kernel, seen from the node netns ------------------------------------------------------


class NodeNft:
    """`nft` run inside the node's network namespace."""

    def __init__(self, netns: str) -> None:
        self.netns = netns

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, "nft", *args],
            capture_output=True,
            text=True,
            check=False,
        )

    def element(self, set_name: str, key: str) -> str:
        """The `nft get element` answer for one key ('' when absent)."""
        proc = self.run("get", "element", "ip", "kpx", set_name, f"{{ {key} }}")
        return proc.stdout if proc.returncode == 0 else ""

    def service_vips(self) -> set[str]:
        """The VIPs (port 80/tcp) in the service-ips map."""
        proc = self.run("list", "map", "ip", "kpx", "service-ips")
        return set(_VIP_RE.findall(proc.stdout)) if proc.returncode == 0 else set()


class KernelProbe(LineHelper):
    """bench/kernel_probe.py in the node netns: netlink lookups of buckets, or a count."""

    def __init__(self, topo: Topology, node: Node) -> None:
        super().__init__(topo, node, PROBE_HELPER)

    def endpoints(self, vip: str) -> list[str]:
        """'IP:PORT' (or '-') of endpoints-10[vip . tcp . 80 . b] for each bucket b."""
        n = ENDPOINTS_PER_SERVICE
        return self.ask(f"buckets kpx endpoints-{n} {vip} {SERVICE_PORT} {n}").split()

    def count(self) -> int:
        """service-ips elements for tcp/80."""
        return int(self.ask(f"count ip kpx service-ips {SERVICE_PORT}"))


# ---- the agent ---------------------------------------------------------------------------------


@dataclass
class AgentRun:
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_mono: float
    started_wall: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the agent exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the agent leaves its rules in place), SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def log_time(self, needle: str) -> float | None:
        """Seconds from the agent's start to its first log line containing `needle`."""
        with contextlib.suppress(OSError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                if needle in line and (m := _LOG_TIME_RE.match(line)):
                    stamp = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
                    return stamp.timestamp() - self.started_wall
        return None


def start_agent(
    topo: Topology, node: Node, cluster: Cluster, extra: Sequence[str] = ()
) -> AgentRun:
    log_path = topo.tmpdir / "agent.log"
    argv = [
        sys.executable,
        "-m",
        "kpx_agent.cli",
        "--mode",
        "nftables",
        "--node-name",
        NODE_NAME,
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--cluster-cidr",
        CLUSTER_CIDR,
        "--metrics-bind-address",
        METRICS_ADDRESS,
        *extra,
    ]
    with log_path.open("wb") as out:
        started_wall, started_mono = time.time(), time.monotonic()
        proc = topo.run(node, argv, stdout=out, stderr=subprocess.STDOUT)
    return AgentRun(proc, log_path, started_mono, started_wall)


def agent_metrics(topo: Topology, node: Node) -> dict[str, float]:
    """A few of the agent's own metrics (informative only: the figures come from the kernel)."""
    proc = topo.exec(node, ["curl", "-s", "--max-time", "5", f"http://{METRICS_ADDRESS}/metrics"])
    wanted = (
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_sync_proxy_rules_service_changes",
        "kpx_watch_received_bytes",
        "kpx_programmed_elements",
    )
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(proc.stdout):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            label = ",".join(f"{v}" for v in sample.labels.values())
            out[f"{sample.name}{'{' + label + '}' if label else ''}"] = sample.value
    return out


# ---- measurements ------------------------------------------------------------------------------


@dataclass
class ColdStart:
    seconds: float = 0.0  # agent start -> the poll that saw all N VIPs ended
    confirmed_s: float = 0.0  # ... -> the full listing that confirmed N VIPs ended
    polls: int = 0
    lists_done_s: float | None = None  # from the agent's log, informative
    agent_cpu_s: float = 0.0
    agent_children_cpu_s: float = 0.0
    apiserver_cpu_s: float = 0.0
    relay_cpu_s: float = 0.0


def wait_cold_start(
    probe: KernelProbe, nft: NodeNft, agent: AgentRun, vips: Sequence[str]
) -> ColdStart:
    """Count service-ips elements (tcp/80) over netlink until there are N; confirm with
    `nft list map` that they are exactly our VIPs (if not, poll on)."""
    want = set(vips)
    result = ColdStart()
    while True:
        agent.check_alive()
        if time.monotonic() - agent.started_mono > COLD_START_TIMEOUT:
            raise TimeoutError(f"not all VIPs in the kernel; agent log:\n{agent.log_tail()}")
        result.polls += 1
        if probe.count() < len(want):
            time.sleep(COLD_POLL_INTERVAL)
            continue
        seen = time.monotonic()
        present = len(nft.service_vips() & want)
        listed = time.monotonic()
        if present == len(want):
            result.seconds = seen - agent.started_mono
            result.confirmed_s = listed - agent.started_mono
            return result
        log(f"  only {present}/{len(want)} of our VIPs listed; polling again")


@dataclass
class Change:
    service: int
    latency_ms: float
    ack_ms: float
    polls: int
    bucket: int  # where the new address landed


@dataclass
class Changes:
    samples: list[Change] = field(default_factory=list)
    gap_s: float = 0.0
    poll_ms: float = 0.0  # mean duration of one netlink lookup (the resolution)
    nft_get_s: float = 0.0  # mean duration of one `nft get element` (the cross-check)

    def latencies(self) -> list[float]:
        return [c.latency_ms for c in self.samples]


def measure_change(
    api: ApiClient, probe: KernelProbe, vips: Sequence[str], svc: int, k: int
) -> Change:
    """Change the last endpoint of one slice; time until the kernel's buckets for that VIP
    hold the new address and no longer the old one (whatever order the agent gives them)."""
    addrs = endpoint_addresses(svc)
    old = f"{addrs[-1][0]}:{TARGET_PORT}"
    new = f"{changed_address(k)}:{TARGET_PORT}"
    addrs[-1] = (changed_address(k), addrs[-1][1])
    path = slices_path(NAMESPACE, f"{svc_name(svc)}-1")
    t0 = time.monotonic()
    api.merge_patch(path, {"endpoints": endpoints(addrs)})
    acked = time.monotonic()
    polls = 0
    while True:
        buckets = probe.endpoints(vips[svc])
        polls += 1
        seen = time.monotonic()
        if new in buckets and old not in buckets:
            return Change(svc, (seen - t0) * 1000, (acked - t0) * 1000, polls, buckets.index(new))
        if seen - t0 > CHANGE_TIMEOUT:
            raise TimeoutError(f"{vips[svc]}: buckets {buckets}, never with {new} for {old}")
        time.sleep(CHANGE_POLL_INTERVAL)


def cross_check(nft: NodeNft, vips: Sequence[str], change: Change, k: int) -> float:
    """`nft get element` must agree with the netlink lookup; its duration."""
    key = f"{vips[change.service]} . tcp . {SERVICE_PORT} . {change.bucket}"
    t0 = time.monotonic()
    answer = nft.element(f"endpoints-{ENDPOINTS_PER_SERVICE}", key)
    elapsed = time.monotonic() - t0
    if f": {changed_address(k)} . {TARGET_PORT} " not in answer:
        raise RuntimeError(f"nft get element {key} disagrees with netlink: {answer!r}")
    return elapsed


def measure_changes(
    api: ApiClient,
    probe: KernelProbe,
    nft: NodeNft,
    agent: AgentRun,
    vips: Sequence[str],
    count: int,
    gap: float,
) -> Changes:
    rng = random.Random(len(vips))
    result = Changes(gap_s=gap)
    nft_times = []
    for k, svc in enumerate(rng.sample(range(len(vips)), min(count, len(vips)))):
        agent.check_alive()
        change = measure_change(api, probe, vips, svc, k)
        result.samples.append(change)
        started = time.monotonic()
        nft_times.append(cross_check(nft, vips, change, k))
        time.sleep(max(0.0, gap - (time.monotonic() - started)))
    result.nft_get_s = sum(nft_times) / len(nft_times)
    t0 = time.monotonic()
    for _ in range(100):
        probe.endpoints(vips[0])
    result.poll_ms = (time.monotonic() - t0) / 100 * 1000
    return result


@dataclass
class Work:
    """What one phase cost the agent (differences between its start and its end)."""

    events: int = 0
    agent_cpu_s: float = 0.0
    children_cpu_s: float = 0.0  # its `nft` processes
    full_syncs: float = 0.0
    partial_syncs: float = 0.0
    service_changes: float = 0.0  # service ports whose node-local state changed


@dataclass
class Snapshot:
    cpu: tuple[float, float]
    metrics: dict[str, float]


def snapshot(topo: Topology, node: Node, agent: AgentRun, cpu_first: bool) -> Snapshot:
    """The agent's CPU and metrics; the metrics scrape (which costs the agent CPU) is kept
    outside the measured window: after the CPU read at its start, before it at its end."""
    if cpu_first:
        cpu = proc_cpu_seconds(agent.pid)
        return Snapshot(cpu, agent_metrics(topo, node))
    metrics = agent_metrics(topo, node)
    return Snapshot(proc_cpu_seconds(agent.pid), metrics)


def work_between(a: Snapshot, b: Snapshot, events: int) -> Work:
    def delta(name: str) -> float:
        return b.metrics.get(name, 0.0) - a.metrics.get(name, 0.0)

    return Work(
        events=events,
        agent_cpu_s=b.cpu[0] - a.cpu[0],
        children_cpu_s=b.cpu[1] - a.cpu[1],
        full_syncs=delta("kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        partial_syncs=delta("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        service_changes=delta("kubeproxy_sync_proxy_rules_service_changes_total"),
    )


def update_node_status(api: ApiClient, agent: AgentRun, count: int, gap: float) -> None:
    """`count` status updates of the agent's Node, as a kubelet's heartbeat makes them: the
    Ready condition with a new heartbeat time and message; nothing the agent uses changes."""
    path = f"/api/v1/nodes/{NODE_NAME}/status"
    for k in range(count):
        agent.check_alive()
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": f"heartbeat {k}",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        api.merge_patch(path, {"status": {"conditions": [condition]}})
        time.sleep(gap)


# ---- one size ----------------------------------------------------------------------------------


@dataclass
class Result:
    services: int
    endpoints_per_service: int
    creation: Creation
    cold: ColdStart  # the last cold start (the agent measured afterwards)
    cold_runs_s: list[float]
    changes: Changes
    change_work: Work = field(default_factory=Work)
    node_work: Work = field(default_factory=Work)
    peak_rss_mb: float = 0.0
    rss_end_mb: float = 0.0
    agent_cpu_s: float = 0.0
    agent_children_cpu_s: float = 0.0
    agent_metrics: dict[str, float] = field(default_factory=dict)
    run_seconds: float = 0.0
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)  # when the size started

    @property
    def cold_start_s(self) -> float:
        return median(self.cold_runs_s)


def _relay_cpu(topo: Topology) -> float:
    return sum(
        proc_cpu_seconds(pid)[0]
        for pid in pids_with_env(ENV_MARK, topo.prefix, "kpx_cluster.relay")
    )


def cold_start(
    topo: Topology, node: Node, cluster: Cluster, vips: Sequence[str], opts: Options
) -> tuple[AgentRun, ColdStart]:
    """Start the agent into a kernel without kpx tables; measure until all VIPs are in."""
    nft, probe = NodeNft(node.netns), KernelProbe(topo, node)
    try:
        if probe.count():
            raise RuntimeError("kpx tables left from a previous agent")
        api_pid = component_pid(cluster, "kube-apiserver")
        api_cpu0 = proc_cpu_seconds(api_pid)[0] if api_pid else 0.0
        relay_cpu0 = _relay_cpu(topo)
        agent = start_agent(topo, node, cluster, opts.agent_args)
        log(f"agent started (pid {agent.pid}); waiting for {len(vips)} VIPs in the kernel")
        cold = wait_cold_start(probe, nft, agent, vips)
    finally:
        probe.close()
    cold.agent_cpu_s, cold.agent_children_cpu_s = proc_cpu_seconds(agent.pid)
    cold.apiserver_cpu_s = (proc_cpu_seconds(api_pid)[0] - api_cpu0) if api_pid else 0.0
    cold.relay_cpu_s = _relay_cpu(topo) - relay_cpu0
    cold.lists_done_s = agent.log_time("initial lists done")
    log(f"cold start: {cold.seconds:.2f}s (confirmed at {cold.confirmed_s:.2f}s)")
    return agent, cold


def remove_rules(topo: Topology, node: Node) -> None:
    """`proxy-agent cleanup`: the node's kernel is back to no kpx tables."""
    argv = [sys.executable, "-m", "kpx_agent.cli", "cleanup", "--mode", "nftables"]
    topo.exec(node, argv, check=True)


def measure_running(
    topo: Topology, node: Node, api: ApiClient, agent: AgentRun, vips: Sequence[str], opts: Options
) -> tuple[Changes, dict[str, Any]]:
    """Changes, then the agent's memory, CPU and metrics."""
    time.sleep(SETTLE_SECONDS)
    agent.check_alive()
    nft, probe = NodeNft(node.netns), KernelProbe(topo, node)
    log(f"changing {opts.changes} EndpointSlices, one every {opts.gap:.1f}s")
    before = snapshot(topo, node, agent, cpu_first=True)
    try:
        changed = measure_changes(api, probe, nft, agent, vips, opts.changes, opts.gap)
    finally:
        probe.close()
    time.sleep(opts.gap)  # the last change's conntrack cleanup and metrics
    after_changes = snapshot(topo, node, agent, cpu_first=False)
    lat = changed.latencies()
    log(f"change: median {median(lat):.1f} ms, p90 {percentile(lat, 90):.1f} ms")
    log(f"updating the Node's status {opts.node_updates} times, one every {opts.gap:.1f}s")
    start_nodes = snapshot(topo, node, agent, cpu_first=True)
    update_node_status(api, agent, opts.node_updates, opts.gap)
    after_nodes = snapshot(topo, node, agent, cpu_first=False)
    stats: dict[str, Any] = {
        "change_work": work_between(before, after_changes, len(changed.samples)),
        "node_work": work_between(start_nodes, after_nodes, opts.node_updates),
    }
    log(f"node updates: {stats['node_work']}")
    stats["memory_kb"] = proc_memory_kb(agent.pid)
    stats["cpu"] = proc_cpu_seconds(agent.pid)
    stats["metrics"] = agent_metrics(topo, node)
    return changed, stats


def run_agent(
    cluster: Cluster, api: ApiClient, vips: Sequence[str], opts: Options
) -> tuple[list[ColdStart], Changes, dict[str, Any]]:
    """Start the agent in a node netns, take every measurement, stop it, remove the netns."""
    with Topology() as topo:
        exit_on_sigterm()  # unwind through this `with` and the control plane's `finally`
        node = topo.add_node(NODE_NAME)
        topo.expose_host_port(cluster.apiserver_port)
        colds = []
        for i in range(max(1, opts.cold_starts)):
            agent, cold = cold_start(topo, node, cluster, vips, opts)
            colds.append(cold)
            if i < opts.cold_starts - 1:
                agent.stop()
                remove_rules(topo, node)
        try:
            changed, stats = measure_running(topo, node, api, agent, vips, opts)
        except Exception:
            log(f"agent log tail:\n{agent.log_tail()}")
            raise
        finally:
            agent.stop()
            if opts.keep_log is not None:
                shutil.copyfile(agent.log_path, opts.keep_log)
    return colds, changed, stats


def run_size(n: int, opts: Options) -> Result:
    started, load = time.monotonic(), os.getloadavg()
    log(f"=== {n} Services x {ENDPOINTS_PER_SERVICE} endpoints")
    with bench_cluster("bench") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            vips, creation = create_workload(cluster, api, n)
            log(f"created in {creation.total_s:.1f}s ({2 * n / creation.total_s:.0f} objects/s)")
            time.sleep(max(0.0, creation.node_created + NODE_SETTLE_SECONDS - time.monotonic()))
            colds, changed, stats = run_agent(cluster, api, vips, opts)
        finally:
            api.close()
    cpu, children = stats["cpu"]
    return Result(
        services=n,
        endpoints_per_service=ENDPOINTS_PER_SERVICE,
        creation=creation,
        cold=colds[-1],
        cold_runs_s=[c.seconds for c in colds],
        changes=changed,
        change_work=stats["change_work"],
        node_work=stats["node_work"],
        peak_rss_mb=stats["memory_kb"].get("VmHWM", 0) / 1024,
        rss_end_mb=stats["memory_kb"].get("VmRSS", 0) / 1024,
        agent_cpu_s=cpu,
        agent_children_cpu_s=children,
        agent_metrics=stats["metrics"],
        run_seconds=time.monotonic() - started,
        load_average=load,
    )


# ---- reporting ---------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(r: Result, info: Mapping[str, str]) -> str:
    n, lat = r.services, r.changes.latencies()
    known = UPSTREAM.get(n)
    up = (
        {
            "start_s": f"{known['start_s']} s",
            "change_ms": f"{known['change_ms']} ms",
            "rss_mb": f"{known['rss_mb']} MB",
        }
        if known
        else {"start_s": "n/a", "change_ms": "n/a", "rss_mb": "n/a"}
    )
    med, p90 = median(lat), percentile(lat, 90)
    start_goal = f"< {GOALS['cold_start_s']:.0f} s (at {GOALS['cold_start_at']:,})"
    if n == GOALS["cold_start_at"]:
        start_goal += f": {_verdict(r.cold_start_s < GOALS['cold_start_s'])}"
    change_goal = f"< {GOALS['change_median_ms']:.0f} ms: {_verdict(med < 50)}"
    rows = [
        (
            f"cold start (agent start -> N VIPs in kernel), median of {len(r.cold_runs_s)}",
            f"{r.cold_start_s:.2f} s",
            start_goal,
            up["start_s"],
        ),
        (
            f"single change, median ({len(lat)} changes)",
            f"{med:.1f} ms",
            change_goal,
            up["change_ms"],
        ),
        ("single change, p90", f"{p90:.1f} ms", "", ""),
        ("agent peak RSS (VmHWM)", f"{r.peak_rss_mb:.0f} MB", "", up["rss_mb"]),
        (
            "agent CPU: last cold start / whole run",
            f"{r.cold.agent_cpu_s:.2f} s / {r.agent_cpu_s:.2f} s",
            "",
            "",
        ),
        (
            "`nft` children CPU: last cold start / whole run",
            f"{r.cold.agent_children_cpu_s:.2f} s / {r.agent_children_cpu_s:.2f} s",
            "",
            "",
        ),
        (
            f"{r.changes.gap_s:.1f} s apart: agent CPU (+ `nft` children) per single "
            "EndpointSlice change",
            _per_event_cell(r.change_work),
            "",
            "",
        ),
        (
            f"{r.node_work.events} Node status updates: agent CPU (+ `nft` children), in all",
            _work_cell(r.node_work),
            "no recompute, no kernel work",
            "",
        ),
        (
            "creating N Services + N EndpointSlices",
            f"{r.creation.total_s:.1f} s ({r.creation.services_s:.1f} + {r.creation.slices_s:.1f})",
            "",
            "",
        ),
    ]
    details = _details(r)
    return (
        f"## nftables agent at {n:,} Services x {r.endpoints_per_service} endpoints\n\n"
        f"Machine: {machine_line(info)}.\n\n"
        + markdown_table(
            ("metric", "kpx agent", "goal", "kube-proxy v1.36.2 nftables (kind, this machine)"),
            rows,
        )
        + "\n"
        + "\n".join(f"- {line}" for line in details)
        + "\n"
    )


def _syncs(w: Work) -> str:
    return (
        f"{w.full_syncs:.0f} full + {w.partial_syncs:.0f} partial syncs, "
        f"{w.service_changes:.0f} service ports changed"
    )


def _work_cell(w: Work) -> str:
    return f"{w.agent_cpu_s:.2f} s (+ {w.children_cpu_s:.2f} s); {_syncs(w)}"


def _per_event_cell(w: Work) -> str:
    n = max(1, w.events)
    return (
        f"{w.agent_cpu_s / n * 1000:.0f} ms (+ {w.children_cpu_s / n * 1000:.0f} ms); "
        f"{w.events} changes: {_syncs(w)}"
    )


def _details(r: Result) -> list[str]:
    lat = r.changes.latencies()
    m = r.agent_metrics
    full = m.get("kubeproxy_sync_full_proxy_rules_duration_seconds_sum", 0.0)
    full_n = m.get("kubeproxy_sync_full_proxy_rules_duration_seconds_count", 0.0)
    part = m.get("kubeproxy_sync_partial_proxy_rules_duration_seconds_sum", 0.0)
    part_n = m.get("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", 0.0)
    runs = ", ".join(f"{x:.2f}" for x in r.cold_runs_s)
    lines = [
        f"Cold starts: {runs} s, each into a kernel without kpx tables (`proxy-agent cleanup` "
        "between runs). Last run: the first netlink count of `service-ips` that found all N VIPs "
        f"({r.cold.polls} polls, one every few ms); the `nft list map` that confirmed they are "
        f"exactly our VIPs ended at {r.cold.confirmed_s:.2f} s. Agent log: initial lists done at "
        + (f"{r.cold.lists_done_s:.2f} s." if r.cold.lists_done_s is not None else "n/a."),
        f"During cold start: apiserver CPU {r.cold.apiserver_cpu_s:.2f} s, apiserver relays "
        f"(host <-> node netns) CPU {r.cold.relay_cpu_s:.2f} s.",
        f"Changes: min {min(lat):.1f} / median {median(lat):.1f} / p90 "
        f"{percentile(lat, 90):.1f} / max {max(lat):.1f} ms, measured from sending the PATCH "
        f"to the end of the netlink lookup of the VIP's 10 buckets that showed the new address "
        f"and not the old (PATCH acknowledged after "
        f"{median([c.ack_ms for c in r.changes.samples]):.1f} ms median; one lookup of 10 "
        f"buckets takes {r.changes.poll_ms:.2f} ms); one change every {r.changes.gap_s:.1f} s "
        "(beyond minSyncPeriod 1 s). Every new address was cross-checked with "
        f"`nft get element`, which takes {r.changes.nft_get_s:.2f} s at this size.",
    ]
    if full_n:
        lines.append(
            f"Agent's own sync metrics: {full_n:.0f} full sync(s), {full / full_n:.2f} s mean; "
            + (
                f"{part_n:.0f} partial syncs, {part / part_n * 1000:.1f} ms mean."
                if part_n
                else "no partial syncs."
            )
        )
    c = r.creation
    cpu = ", ".join(f"{k} {v:.1f} s" for k, v in c.control_plane_cpu_s.items())
    chunks = ", ".join(f"{x:.1f}" for x in c.service_chunks_s)
    lines.append(
        f"Creation: {WORKERS} concurrent POSTs over kept-alive HTTPS; Services at "
        f"{r.services / c.services_s:.0f}/s (seconds per {CREATE_CHUNK:,}: {chunks}), "
        f"EndpointSlices at {r.services / c.slices_s:.0f}/s; control-plane CPU meanwhile: {cpu}."
    )
    load = " / ".join(f"{x:.2f}" for x in r.load_average)
    lines.append(
        f"Run took {r.run_seconds:.0f} s in all (control plane, creation, measurements); "
        f"load average when it started (1/5/15 min): {load}."
    )
    return lines


def to_json(r: Result, info: Mapping[str, str]) -> dict[str, Any]:
    lat = r.changes.latencies()
    data = asdict(r)
    data["benchmark"] = "agent_scale"
    data["machine"] = dict(info)
    data["creation"]["total_s"] = r.creation.total_s
    data["summary"] = {
        "cold_start_s": round(r.cold_start_s, 3),
        "change_median_ms": round(median(lat), 1),
        "change_p90_ms": round(percentile(lat, 90), 1),
        "peak_rss_mb": round(r.peak_rss_mb, 1),
        "agent_cpu_s": r.agent_cpu_s,
    }
    data["goals"] = GOALS
    data["upstream_kube_proxy_v1_36_2_kind"] = UPSTREAM.get(r.services)
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, help="run only this size (default: 1000, 10000)")
    parser.add_argument("--changes", type=int, default=20, help="single changes to time")
    parser.add_argument("--gap", type=float, default=1.2, help="seconds between changes")
    parser.add_argument("--cold-starts", type=int, default=3, help="cold starts to time")
    parser.add_argument("--node-updates", type=int, default=50, help="Node status updates")
    parser.add_argument("--agent-verbose", action="store_true", help="run the agent with -v")
    parser.add_argument("--keep-agent-log", type=Path, help="copy the agent's log to this file")
    parser.add_argument(
        "--no-write", action="store_true", help="print only; leave bench/results alone"
    )
    args = parser.parse_args()
    opts = Options(
        changes=args.changes,
        gap=args.gap,
        cold_starts=args.cold_starts,
        node_updates=args.node_updates,
        agent_args=("-v",) if args.agent_verbose else (),
        keep_log=args.keep_agent_log,
        write=not args.no_write,
    )
    exit_on_sigterm()
    info = machine_info()
    for n in [args.services] if args.services else DEFAULT_SIZES:
        result = run_size(n, opts)
        markdown = report(result, info)
        print("\n" + markdown)
        if not opts.write:
            continue
        log(f"wrote {write_json(f'agent_scale-{n}.json', to_json(result, info))}")
        log(f"updated {update_latest(f'agent_scale-{n}', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
