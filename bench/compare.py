"""Side by side: upstream kube-proxy v1.36.2 and the kpx agent, in nftables and iptables modes.

Against ONE local control plane (`bench-<pid>`), for each size N (default 1,000 then 10,000;
the workload grows from one size to the next) and each mode both implement:

1. the workload (bench/workload.py): N ClusterIP Services (one TCP port 80 -> 8080) and N
   EndpointSlices of 10 ready endpoints, and the Node `bench-node-0` with an InternalIP
   (kube-proxy waits 30 s for a node IP without one);
2. upstream kube-proxy, then the kpx agent, each ALONE in a FRESH node network namespace
   (a new kpx_cluster Topology per start; the apiserver reached through the harness relay):
   - cold start: process start -> the kernel holds all N Services, observed by
     bench/kernel_probe.py over netlink (nftables: elements of the `service-ips` map of
     `ip kube-proxy` / `ip kpx`; iptables: rules of KUBE-SERVICES / KPX-SERVICES), then
     confirmed from a full dump (`nft list map`, `iptables-save -t nat`); every start capped
     by --cold-timeout (upstream iptables needs ~42 min at 10,000: reported as stopped);
   - single change: one EndpointSlice gets one endpoint replaced -> the kernel's DNAT
     targets for that Service hold the new endpoint and not the old (20 changes, spaced
     beyond both minSyncPeriods);
   - burst: 100 EndpointSlices changed at once -> all 100 visible;
   - with --sustained K: K more EndpointSlices changed in batches spread over
     --sustained-seconds (each stamped with the trigger-time annotation
     `endpoints.kubernetes.io/last-change-trigger-time` as it is sent, as the EndpointSlice
     controller stamps it) -> every one read back from the kernel, and the p50 and p99 of
     kubeproxy_network_programming_duration_seconds over the burst (both export it);
   - CPU (process + its children: nft, iptables-restore) and peak RSS (VmHWM) from /proc;
   - with --node-updates K: K status updates of the Node (a kubelet heartbeat's: nothing a
     proxy uses changes) and what they cost (CPU, syncs from the process's own metrics);
   - ruleset size (lines, chains, rules, set/map elements);
3. equivalence: the kernel's (Service IP, port) -> {endpoint IP:port} mappings of both
   systems, read back from full dumps (bench/ruleset_readback.py), compared with each other at
   the same apiserver state and with that state.

Usage: python3 bench/compare.py [--services N] [--modes nftables,iptables]
       [--systems kube-proxy,kpx] [--node-updates K] [--agent-verbose] [--no-write]
The one report (bench/report.py) is written to bench/results/compare-<N>.json and
compare-<N>.md (and its section of latest.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from benchlib import (
    RESULTS_DIR,
    ApiClient,
    LineHelper,
    bench_cluster,
    compile_agent_sources,
    component_pid,
    exit_on_sigterm,
    log,
    machine_info,
    median,
    percentile,
    proc_cpu_seconds,
    proc_memory_kb,
    update_latest,
    wait_until_quiet,
    write_json,
)
from kpx_cluster.binaries import kubernetes_binary
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Topology
from report import (
    KPX,
    KUBE_PROXY,
    MODES,
    SYSTEMS,
    Burst,
    Change,
    ColdStart,
    ModeResult,
    Options,
    SizeResult,
    Sustained,
    SystemResult,
    Work,
    bucket_quantile,
    report,
    to_json,
)
from ruleset_readback import (
    Key,
    Mappings,
    Readback,
    compare,
    iptables_readback,
    iptables_stats,
    nft_readback,
    nft_stats,
    service_map_chains,
)
from workload import (
    CLUSTER_CIDR,
    ENDPOINTS_PER_SERVICE,
    NODE_NAME,
    SERVICE_PORT,
    Workload,
    create_node,
    grow,
)

METRICS_ADDRESS = "127.0.0.1:10249"
HEALTHZ_ADDRESS = "127.0.0.1:10256"
PROBE_HELPER = Path(__file__).resolve().parent / "kernel_probe.py"
DEFAULT_SIZES = (1000, 10000)
WORKERS = 8
SETTLE_SECONDS = 3.0
CHANGE_TIMEOUT = 120.0
DUMP_TIMEOUT = 900.0
# Pollers sleep at least twice as long as their last poll took, so they take at most a third
# of one core from the process measured (the machine has two); the resolution is reported.
MIN_POLL_SLEEP = 0.001
_LOG_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


# ---- what each system programs, and how to read it -------------------------------------------


@dataclass(frozen=True)
class Dataplane:
    system: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.system} {self.mode}"

    @property
    def nft_table(self) -> str:
        return "kube-proxy" if self.system == KUBE_PROXY else "kpx"

    @property
    def services_chain(self) -> str:
        return "KUBE-SERVICES" if self.system == KUBE_PROXY else "KPX-SERVICES"

    def argv(self, kubeconfig: Path, agent_args: Sequence[str] = ()) -> list[str]:
        if self.system == KUBE_PROXY:
            return [
                str(kubernetes_binary("kube-proxy")),
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={NODE_NAME}",
                f"--proxy-mode={self.mode}",
                f"--cluster-cidr={CLUSTER_CIDR}",
                f"--metrics-bind-address={METRICS_ADDRESS}",
                f"--healthz-bind-address={HEALTHZ_ADDRESS}",
                # conntrack: leave the kernel's settings alone (nf_conntrack_max is global).
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                "--v=2",  # one line per sync with its duration
            ]
        return [
            sys.executable,
            "-m",
            agent_module(self.source_tree()),
            "--mode",
            self.mode,
            "--node-name",
            NODE_NAME,
            "--kubeconfig",
            str(kubeconfig),
            "--cluster-cidr",
            CLUSTER_CIDR,
            "--metrics-bind-address",
            METRICS_ADDRESS,
            "--healthz-bind-address",
            HEALTHZ_ADDRESS,
            *agent_args,
        ]

    def source_tree(self) -> Path | None:
        """The tree the kpx agent runs from, as this process finds it (None: not kpx)."""
        if self.system == KUBE_PROXY:
            return None
        spec = importlib.util.find_spec("kpx_agent")
        if spec is None or spec.origin is None:
            raise RuntimeError("kpx_agent is not importable (make setup-python)")
        return Path(spec.origin).resolve().parent.parent.parent

    def count_request(self) -> str:
        """Probe request whose answer reaches N once all N Services are in the kernel."""
        if self.mode == "nftables":
            return f"count ip {self.nft_table} service-ips {SERVICE_PORT}"
        return f"rules ip nat {self.services_chain}"

    def endpoints_request(self, key: Key, chain: str) -> str:
        if self.mode == "nftables" and self.system == KPX:
            n = ENDPOINTS_PER_SERVICE
            return f"buckets kpx endpoints-{n} {key[0]} {key[2]} {n}"
        table = self.nft_table if self.mode == "nftables" else "nat"
        return f"dnat ip {table} {chain}"

    def confirm(self, topo: Topology, node: Node) -> dict[Key, str]:
        """Service keys present in the kernel and the chain each goes to (a full listing)."""
        if self.mode == "nftables":
            out = topo.exec(
                node, ["nft", "list", "map", "ip", self.nft_table, "service-ips"], DUMP_TIMEOUT
            )
            return service_map_chains(out.stdout) if out.returncode == 0 else {}
        out = topo.exec(node, ["iptables-save", "-t", "nat"], DUMP_TIMEOUT)
        readback = iptables_readback(out.stdout, self.services_chain)
        return {k: c for k, c in readback.chains.items() if readback.mappings.get(k)}

    def readback(self, topo: Topology, node: Node) -> tuple[Readback, float, str]:
        """Full mappings from a dump; its duration; the dump (JSON for nftables)."""
        t0 = time.monotonic()
        if self.mode == "nftables":
            out = topo.exec(node, ["nft", "-j", "list", "ruleset"], DUMP_TIMEOUT, check=True)
            result = nft_readback(out.stdout, self.nft_table)
        else:
            out = topo.exec(node, ["iptables-save", "-t", "nat"], DUMP_TIMEOUT, check=True)
            result = iptables_readback(out.stdout, self.services_chain)
        return result, time.monotonic() - t0, out.stdout

    def ruleset_size(
        self, topo: Topology, node: Node, nft_json: str, keep: Path | None
    ) -> dict[str, int]:
        """Lines and bytes of the whole dump (both families), chains, rules, set/map elements;
        the dumps are saved as `keep`.* when given."""
        if self.mode == "nftables":
            text = topo.exec(node, ["nft", "list", "ruleset"], DUMP_TIMEOUT, check=True).stdout
            stats = nft_stats(nft_json)
            stats["lines"] = text.count("\n")
            stats["bytes"] = len(text.encode())
            if keep is not None:
                Path(f"{keep}.nft").write_text(text)
                Path(f"{keep}.json").write_text(nft_json)
            return stats
        totals = {"lines": 0, "bytes": 0, "chains": 0, "rules": 0}
        for tool in ("iptables-save", "ip6tables-save"):
            dump = topo.exec(node, [tool], DUMP_TIMEOUT, check=True).stdout
            for k, v in iptables_stats(dump).items():
                totals[k] += v
            totals["bytes"] += len(dump.encode())
            if keep is not None:
                Path(f"{keep}.{tool}").write_text(dump)
        return totals


class Probe(LineHelper):
    """bench/kernel_probe.py inside the node netns."""

    def __init__(self, topo: Topology, node: Node) -> None:
        super().__init__(topo, node, PROBE_HELPER)

    def endpoints(self, request: str) -> set[str]:
        return {w for w in self.ask(request).split() if w != "-"}


def _poll_sleep(took: float, floor: float = MIN_POLL_SLEEP) -> None:
    time.sleep(max(floor, 2 * took))


# ---- processes ---------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [int(p) for p in Path(task.path, "children").read_text().split()]
    return out


def tree_cpu(pid: int) -> tuple[float, float]:
    """(the process's own CPU seconds, its children's: reaped ones (cutime+cstime) plus any
    still running, with their own descendants)."""
    own, reaped = proc_cpu_seconds(pid)
    live = 0.0
    todo = _children(pid)
    while todo:
        child = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            c_own, c_reaped = proc_cpu_seconds(child)
            live += c_own + c_reaped
            todo += _children(child)
    return own, reaped + live


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float  # monotonic
    started_wall: float = 0.0  # time.time() at the same moment

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def log_time(self, needle: str) -> float | None:
        """Seconds from the start to the kpx agent's first log line containing `needle` (its
        timestamps have millisecond resolution); None while there is none."""
        with contextlib.suppress(OSError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                if needle in line and (m := _LOG_TIME_RE.match(line)):
                    stamp = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
                    return stamp.timestamp() - self.started_wall
        return None

    def stop(self) -> None:
        """SIGTERM the whole process group (kube-proxy's iptables-restore too), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def agent_module(tree: Path | None) -> str:
    """What `python -m` runs as the agent from `tree`: what the `proxy-agent` command runs
    (kpx_agent/__main__.py), or, in a tree from before it, the CLI module."""
    main = tree is not None and (tree / "agents" / "kpx_agent" / "__main__.py").exists()
    return "kpx_agent" if main else "kpx_agent.cli"


def start(
    dp: Dataplane,
    topo: Topology,
    node: Node,
    cluster: Cluster,
    tag: str,
    agent_args: Sequence[str] = (),
) -> Running:
    log_path = topo.tmpdir / f"{tag}.log"
    argv = dp.argv(cluster.kubeconfig, agent_args)
    if (tree := dp.source_tree()) is not None:
        compile_agent_sources(tree)
    with log_path.open("wb") as out:
        started, started_wall = time.monotonic(), time.time()
        proc = topo.run(node, argv, stdout=out, stderr=subprocess.STDOUT)
    return Running(proc, log_path, started, started_wall)


@contextlib.contextmanager
def node_netns(cluster: Cluster) -> Iterator[tuple[Topology, Node]]:
    """A fresh network namespace for the measured node (NODE_NAME), the apiserver reached
    through the harness relay; removed, with everything started in it, on exit."""
    with Topology() as topo:
        exit_on_sigterm()  # unwind through this `with` and the control plane's `finally`
        node = topo.add_node(NODE_NAME)
        topo.expose_host_port(cluster.apiserver_port)
        yield topo, node


@dataclass
class Session:
    """One measured process in a fresh node netns (`measuring`): set `run` once started."""

    topo: Topology
    node: Node
    probe: Probe
    run: Running | None = None


@contextlib.contextmanager
def measuring(cluster: Cluster, what: str, on_error: Callable[[str], None]) -> Iterator[Session]:
    """A fresh node netns with a kernel probe, for one measured process. An exception inside
    is logged with the process's log tail and handed to `on_error` as text, not raised; the
    probe is closed and the process stopped on the way out."""
    with node_netns(cluster) as (topo, node):
        session = Session(topo, node, Probe(topo, node))
        try:
            yield session
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"{what}: FAILED: {error}")
            if session.run is not None:
                log(session.run.log_tail())
            on_error(error)
        finally:
            session.probe.close()
            if session.run is not None:
                session.run.stop()


_RELOAD_RE = re.compile(
    r"numFilterChains=(\d+) numFilterRules=(\d+) numNATChains=(\d+) numNATRules=(\d+)"
)


def ruleset_in_log(path: Path) -> dict[str, int]:
    """kube-proxy (iptables, -v=2) logs the size of each ruleset it restores: the last one."""
    with contextlib.suppress(OSError):
        found = _RELOAD_RE.findall(path.read_text(errors="replace"))
        if found:
            fc, fr, nc, nr = (int(x) for x in found[-1])
            return {"chains": fc + nc, "rules": fr + nr}
    return {}


def metric_families(topo: Topology, node: Node) -> Iterator[Metric]:
    """The process's /metrics, scraped from inside the node netns (nothing when unreadable)."""
    url = f"http://{METRICS_ADDRESS}/metrics"
    proc = topo.exec(node, ["curl", "-s", "--max-time", "10", url])
    with contextlib.suppress(ValueError):
        yield from text_string_to_metric_families(proc.stdout)


def metrics(topo: Topology, node: Node) -> dict[str, float]:
    """Sync-duration sums and counts from the process's /metrics (same names in both)."""
    wanted = (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_network_programming_duration_seconds",
        "kubeproxy_sync_proxy_rules_service_changes",
    )
    out: dict[str, float] = {}
    for family in metric_families(topo, node):
        if family.name not in wanted:
            continue
        for s in family.samples:
            if s.name.endswith(("_sum", "_count", "_total")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


# ---- measurements ------------------------------------------------------------------------------


def wait_cold_start(
    dp: Dataplane,
    probe: Probe,
    run: Running,
    topo: Topology,
    node: Node,
    work: Workload,
    timeout: float,
) -> tuple[ColdStart, dict[Key, str]]:
    """Poll the kernel until it holds all N Services (then confirm with a full listing)."""
    want = set(work.expected())
    result = ColdStart()
    request = dp.count_request()
    spent = 0.0
    while True:
        run.check_alive()
        if time.monotonic() - run.started > timeout:
            result.timed_out = True
            result.seconds = time.monotonic() - run.started
            return result, {}
        t0 = time.monotonic()
        count = int(probe.ask(request))
        took = time.monotonic() - t0
        spent += took
        result.polls += 1
        if count < len(want):
            _poll_sleep(took, 0.005)
            continue
        seen = time.monotonic()
        chains = dp.confirm(topo, node)
        missing = want - set(chains)
        if not missing:
            result.seconds = seen - run.started
            result.confirmed_s = time.monotonic() - run.started
            result.poll_ms = spent / result.polls * 1000
            return result, chains
        log(f"  {len(missing)} of {len(want)} Services missing from the listing; polling on")


def wait_visible(
    probe: Probe, request: str, old: str, new: str, t0: float, deadline: float
) -> tuple[float, int, float]:
    """Poll one Service's endpoints until `new` is in and `old` is out: (seen time, polls,
    time spent polling)."""
    polls, spent = 0, 0.0
    while True:
        p0 = time.monotonic()
        eps = probe.endpoints(request)
        seen = time.monotonic()
        polls += 1
        spent += seen - p0
        if new in eps and old not in eps:
            return seen, polls, spent
        if seen - t0 > deadline:
            raise TimeoutError(f"{request}: {sorted(eps)} never held {new} instead of {old}")
        _poll_sleep(seen - p0)


@dataclass(frozen=True)
class Write:
    """One endpoint of one Service replaced at the apiserver (one EndpointSlice PATCH)."""

    service: int
    old: str  # 'IP:PORT' replaced
    new: str  # 'IP:PORT' in its place
    sent: float  # monotonic: the PATCH was sent
    acked: float  # monotonic: ... and answered


def replace_endpoint(api: ApiClient, work: Workload, svc: int) -> Write:
    """Replace Service svc's last endpoint (Workload.replace_last) with one PATCH."""
    old, new, (path, body) = work.replace_last(svc)
    sent = time.monotonic()
    api.merge_patch(path, body)
    return Write(svc, old, new, sent, time.monotonic())


def time_to_kernel(
    dp: Dataplane, probe: Probe, work: Workload, chains: Mapping[Key, str], write: Write
) -> tuple[Change, float]:
    """Poll the kernel until the written Service's endpoints hold the new endpoint and not the
    old: the change (timed from the PATCH), and the time spent polling."""
    key = work.key(write.service)
    request = dp.endpoints_request(key, chains[key])
    seen, polls, spent = wait_visible(
        probe, request, write.old, write.new, write.sent, CHANGE_TIMEOUT
    )
    latency, ack = (seen - write.sent) * 1000, (write.acked - write.sent) * 1000
    return Change(write.service, latency, ack, polls), spent


def measure_changes(
    dp: Dataplane,
    probe: Probe,
    api: ApiClient,
    work: Workload,
    chains: Mapping[Key, str],
    run: Running,
    picks: Sequence[int],
    gap: float,
    result: SystemResult,
) -> None:
    spent, polls = 0.0, 0
    for svc in picks:
        run.check_alive()
        change, took = time_to_kernel(dp, probe, work, chains, replace_endpoint(api, work, svc))
        spent, polls = spent + took, polls + change.polls
        result.changes.append(change)
        time.sleep(gap)
    result.change_poll_ms = spent / max(1, polls) * 1000


def measure_burst(
    dp: Dataplane,
    probe: Probe,
    api: ApiClient,
    work: Workload,
    chains: Mapping[Key, str],
    picks: Sequence[int],
) -> Burst:
    """Change `picks` at once; wait for the newest write, then check every one of them."""
    planned = [(svc, *work.replace_last(svc)) for svc in picks]
    t0 = time.monotonic()
    answers = api.many("PATCH", [patch for _, _, _, patch in planned])
    acked = time.monotonic()
    versions = [int(a.get("metadata", {}).get("resourceVersion", "0")) for a in answers]
    newest = max(range(len(planned)), key=lambda i: versions[i])
    svc, old, new, _ = planned[newest]
    request = dp.endpoints_request(work.key(svc), chains[work.key(svc)])
    sentinel, _, _ = wait_visible(probe, request, old, new, t0, CHANGE_TIMEOUT)
    pending = {s: (o, n) for s, o, n, _ in planned if s != svc}
    last_seen, passes = sentinel, 0
    while pending:
        passes += 1
        for s, (o, n) in list(pending.items()):
            eps = probe.endpoints(dp.endpoints_request(work.key(s), chains[work.key(s)]))
            if n in eps and o not in eps:
                last_seen = time.monotonic()
                del pending[s]
        if pending and time.monotonic() - t0 > CHANGE_TIMEOUT:
            raise TimeoutError(f"burst: {len(pending)} Services never showed their new endpoint")
    verified = time.monotonic()
    # All in on the first pass: the newest write was applied last, so all were visible by then.
    latency = sentinel if passes <= 1 else last_seen
    return Burst(
        size=len(planned),
        latency_ms=(latency - t0) * 1000,
        sentinel_ms=(sentinel - t0) * 1000,
        acked_ms=(acked - t0) * 1000,
        verified_ms=(verified - t0) * 1000,
        passes=passes,
    )


TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
#: batches of the sustained burst per second
SUSTAINED_BATCHES_PER_S = 10


def measure_sustained(
    dp: Dataplane,
    topo: Topology,
    node: Node,
    api: ApiClient,
    work: Workload,
    picks: Sequence[int],
    seconds: float,
) -> Sustained:
    """Change `picks` (one endpoint each) in batches spread evenly over `seconds`, each stamped
    with the trigger time as it is sent; then read the kernel back until every change is in
    (or CHANGE_TIMEOUT after the last), and read the network-programming histogram's change."""
    before = programming_buckets(topo, node)
    batches = max(1, round(seconds * SUSTAINED_BATCHES_PER_S))
    per = -(-len(picks) // batches)
    t0 = time.monotonic()
    for b, lo in enumerate(range(0, len(picks), per)):
        time.sleep(max(0.0, t0 + b * seconds / batches - time.monotonic()))
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        batch = []
        for svc in picks[lo : lo + per]:
            _old, _new, (path, body) = work.replace_last(svc)
            batch.append((path, {**body, "metadata": {"annotations": {TRIGGER_ANNOTATION: stamp}}}))
        api.many("PATCH", batch)
    sent = time.monotonic()
    expected = work.expected()
    keys = [work.key(svc) for svc in picks]
    out = Sustained(size=len(picks), seconds=seconds, sent_ms=(sent - t0) * 1000)
    while True:
        p0 = time.monotonic()
        readback, _, _ = dp.readback(topo, node)
        out.missing = sum(1 for k in keys if readback.mappings.get(k) != expected[k])
        if not out.missing:
            out.all_in_ms = (time.monotonic() - t0) * 1000
            break
        if time.monotonic() - sent > CHANGE_TIMEOUT:
            break
        _poll_sleep(time.monotonic() - p0)
    after = programming_buckets(topo, node)
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    out.observed = round(delta.get(float("inf"), 0.0))
    out.p50_s, out.p99_s = bucket_quantile(delta, 0.5), bucket_quantile(delta, 0.99)
    return out


def programming_buckets(topo: Topology, node: Node) -> dict[float, float]:
    """kubeproxy_network_programming_duration_seconds: upper bound -> cumulative count (the
    label sets summed)."""
    out: dict[float, float] = {}
    for family in metric_families(topo, node):
        if family.name != "kubeproxy_network_programming_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


@dataclass
class Readbacks:
    """Mappings read back from the kernel: after the last cold start, and at the end."""

    cold: Mappings | None = None
    final: Mappings | None = None


def run_system(
    dp: Dataplane,
    cluster: Cluster,
    api: ApiClient,
    work: Workload,
    opts: Options,
    rng: random.Random,
) -> tuple[SystemResult, Readbacks]:
    """Cold starts (each in a fresh node netns), then, from the last one, changes and burst."""
    result, reads = SystemResult(dp.system, dp.mode), Readbacks()
    n = work.size
    for i in range(max(1, opts.cold_starts)):
        last = i == opts.cold_starts - 1
        with node_netns(cluster) as (topo, node):
            probe = Probe(topo, node)
            run: Running | None = None
            try:
                if int(probe.ask(dp.count_request())):
                    raise RuntimeError("a fresh netns already holds rules")
                waited = wait_until_quiet()  # the same for both systems
                if waited > 1.0:
                    log(f"{dp.label}: waited {waited:.1f} s for the machine to settle")
                api_pid = component_pid(cluster, "kube-apiserver")
                api_cpu0 = proc_cpu_seconds(api_pid)[0] if api_pid else 0.0
                run = start(
                    dp,
                    topo,
                    node,
                    cluster,
                    f"{dp.system}-{dp.mode}-{i}",
                    opts.agent_args if dp.system == KPX else (),
                )
                log(f"{dp.label}: started (pid {run.pid}), waiting for {n:,} Services")
                cold, chains = wait_cold_start(dp, probe, run, topo, node, work, opts.cold_timeout)
                cold.cpu_s, cold.children_cpu_s = tree_cpu(run.pid)
                if api_pid:
                    cold.apiserver_cpu_s = proc_cpu_seconds(api_pid)[0] - api_cpu0
                result.colds.append(cold)
                if cold.timed_out:
                    log(f"{dp.label}: no complete ruleset after {cold.seconds:.0f} s: stopped")
                    result.cpu_cold_s = cold.cpu_s + cold.children_cpu_s
                    mem = proc_memory_kb(run.pid)
                    result.peak_rss_mb = mem.get("VmHWM", 0) / 1024
                    result.log_tail = run.log_tail()
                    result.ruleset_from_log = ruleset_in_log(run.log_path)
                    break
                log(f"{dp.label}: cold start {cold.seconds:.2f} s ({cold.polls} polls)")
                if not last:
                    continue
                result.cpu_cold_s = cold.cpu_s + cold.children_cpu_s
                measure_running(
                    dp, topo, node, probe, run, api, work, chains, opts, rng, result, reads
                )
            except Exception as exc:  # keep what was measured; the next system still runs
                result.error = f"{type(exc).__name__}: {exc}"[:2000]
                if run is not None:
                    result.log_tail = run.log_tail()
                log(f"{dp.label}: FAILED: {result.error}")
                break
            finally:
                probe.close()
                if run is not None:
                    run.stop()
                    if opts.keep_dumps is not None:  # the process's log, next to its dumps
                        logs = opts.keep_dumps / str(n)
                        logs.mkdir(parents=True, exist_ok=True)
                        with contextlib.suppress(OSError):
                            shutil.copyfile(run.log_path, logs / run.log_path.name)
    return result, reads


def measure_running(
    dp: Dataplane,
    topo: Topology,
    node: Node,
    probe: Probe,
    run: Running,
    api: ApiClient,
    work: Workload,
    chains: dict[Key, str],
    opts: Options,
    rng: random.Random,
    result: SystemResult,
    reads: Readbacks,
) -> None:
    keep = None
    if opts.keep_dumps is not None:
        (opts.keep_dumps / str(work.size)).mkdir(parents=True, exist_ok=True)
        keep = opts.keep_dumps / str(work.size) / f"{dp.system}-{dp.mode}"
    readback, took, dump = dp.readback(topo, node)
    result.readback_s.append(round(took, 2))
    reads.cold = readback.mappings
    chains.update(readback.chains)
    cold_keep = Path(f"{keep}-cold") if keep is not None else None
    result.ruleset_cold = dp.ruleset_size(topo, node, dump, cold_keep)
    time.sleep(SETTLE_SECONDS)
    wanted = opts.changes + opts.burst + opts.sustained
    picks = rng.sample(range(work.size), min(work.size, wanted))
    log(f"{dp.label}: {opts.changes} single changes, one every >= {opts.gap:.1f} s")
    measure_changes(dp, probe, api, work, chains, run, picks[: opts.changes], opts.gap, result)
    lat = result.latencies()
    log(f"{dp.label}: change median {median(lat):.1f} ms, p90 {percentile(lat, 90):.1f} ms")
    if opts.burst:
        result.burst = measure_burst(
            dp, probe, api, work, chains, picks[opts.changes : opts.changes + opts.burst]
        )
        log(f"{dp.label}: burst of {opts.burst}: {result.burst.latency_ms:.0f} ms")
    if opts.sustained:
        rest = picks[opts.changes + opts.burst :]
        log(f"{dp.label}: sustained: {len(rest):,} changes over {opts.sustained_seconds:g} s")
        time.sleep(SETTLE_SECONDS)
        result.sustained = measure_sustained(
            dp, topo, node, api, work, rest, opts.sustained_seconds
        )
        log(f"{dp.label}: sustained: {result.sustained}")
    own, children = tree_cpu(run.pid)
    result.cpu_end_s = own + children
    result.measured_s = time.monotonic() - run.started
    mem = proc_memory_kb(run.pid)
    result.peak_rss_mb = mem.get("VmHWM", 0) / 1024
    result.rss_end_mb = mem.get("VmRSS", 0) / 1024
    if opts.node_updates:
        log(f"{dp.label}: {opts.node_updates} Node status updates, one every {opts.gap:.1f} s")
        result.node_work = measure_node_updates(topo, node, run, api, opts.node_updates, opts.gap)
        log(f"{dp.label}: Node status updates: {result.node_work}")
    result.metrics = metrics(topo, node)
    run.check_alive()
    readback, took, dump = dp.readback(topo, node)
    result.readback_s.append(round(took, 2))
    reads.final = readback.mappings
    result.ruleset = dp.ruleset_size(topo, node, dump, keep)


def _counter(m: Mapping[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{"))


def measure_node_updates(
    topo: Topology, node: Node, run: Running, api: ApiClient, count: int, gap: float
) -> Work:
    """`count` status updates of the measured Node, as a kubelet's heartbeat makes them (the
    Ready condition with a new heartbeat time and message: nothing a proxy uses changes), and
    what they cost the process. The metrics scrapes (which cost the process CPU) stay outside
    the window: after the CPU read at its start, before it at its end."""
    cpu0 = tree_cpu(run.pid)
    m0 = metrics(topo, node)
    path = f"/api/v1/nodes/{NODE_NAME}/status"
    for k in range(count):
        run.check_alive()
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
    m1 = metrics(topo, node)
    cpu1 = tree_cpu(run.pid)

    def delta(name: str) -> float:
        return _counter(m1, name) - _counter(m0, name)

    return Work(
        events=count,
        cpu_s=cpu1[0] - cpu0[0],
        children_cpu_s=cpu1[1] - cpu0[1],
        full_syncs=delta("kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        partial_syncs=delta("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        service_changes=delta("kubeproxy_sync_proxy_rules_service_changes_total"),
    )


# ---- one size ----------------------------------------------------------------------------------


def run_mode(
    mode: str, cluster: Cluster, api: ApiClient, work: Workload, opts: Options
) -> ModeResult:
    out = ModeResult(mode)
    keys = list(work.expected())
    upstream_final: Mappings | None = None
    for system in opts.systems:
        dp = Dataplane(system, mode)
        rng = random.Random(f"{work.size}-{mode}-{system}")
        state_at_start = work.expected()
        result, reads = run_system(dp, cluster, api, work, opts, rng)
        out.systems[system] = result
        if reads.cold is not None:
            out.equivalence[f"{system} after cold start = apiserver"] = compare(
                reads.cold, state_at_start, keys
            )
        if system == KPX and reads.cold is not None and upstream_final is not None:
            out.equivalence["kpx after cold start = kube-proxy at its end (same state)"] = compare(
                reads.cold, upstream_final, keys
            )
        if reads.final is not None:
            out.equivalence[f"{system} at its end = apiserver"] = compare(
                reads.final, work.expected(), keys
            )
        if system == KUBE_PROXY:
            upstream_final = reads.final
    for name, comparison in out.equivalence.items():
        log(f"equivalence ({mode}): {name}: {comparison.summary()}")
    return out


def run_size(n: int, cluster: Cluster, api: ApiClient, work: Workload, opts: Options) -> SizeResult:
    started, load = time.monotonic(), os.getloadavg()
    log(f"=== {n:,} Services x {ENDPOINTS_PER_SERVICE} endpoints")
    before = len(work.creation)
    grow(cluster, api, work, n)
    work.settle_node()
    modes = {mode: run_mode(mode, cluster, api, work, opts) for mode in opts.modes}
    return SizeResult(n, modes, work.creation[before:], time.monotonic() - started, load)


# ---- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, help="run only this size (default: 1000, 10000)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    parser.add_argument("--changes", type=int, default=20, help="single changes to time")
    parser.add_argument("--burst", type=int, default=100, help="EndpointSlices in the burst")
    parser.add_argument(
        "--sustained",
        type=int,
        default=0,
        help="EndpointSlice changes of a sustained burst after the burst (0: none)",
    )
    parser.add_argument(
        "--sustained-seconds", type=float, default=10.0, help="the sustained burst's length"
    )
    parser.add_argument("--gap", type=float, default=1.2, help="seconds between changes")
    parser.add_argument("--cold-starts", type=int, default=3, help="cold starts per system")
    parser.add_argument(
        "--cold-timeout", type=float, default=600.0, help="seconds before a cold start is stopped"
    )
    parser.add_argument(
        "--node-updates", type=int, default=0, help="Node status updates to time after the burst"
    )
    parser.add_argument("--agent-verbose", action="store_true", help="run the kpx agent with -v")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--keep-dumps",
        type=Path,
        help="save each system's final ruleset, and each run's log, under DIR/<N>/",
    )
    args = parser.parse_args()
    opts = Options(
        changes=args.changes,
        burst=args.burst,
        gap=args.gap,
        cold_starts=max(1, args.cold_starts),
        cold_timeout=args.cold_timeout,
        modes=tuple(m for m in args.modes.split(",") if m in MODES),
        systems=tuple(s for s in SYSTEMS if s in args.systems.split(",")),
        node_updates=args.node_updates,
        sustained=args.sustained,
        sustained_seconds=args.sustained_seconds,
        agent_args=("-v",) if args.agent_verbose else (),
        write=not args.no_write,
        keep_dumps=args.keep_dumps,
    )
    command = " ".join(["python3 bench/compare.py", *sys.argv[1:]])
    sizes = sorted([args.services] if args.services else DEFAULT_SIZES)
    kubernetes_binary(
        "kube-proxy"
    )  # fails early when `toolchain/build-kubernetes.sh kube-proxy` is due
    exit_on_sigterm()
    info = machine_info()
    work = Workload()
    with bench_cluster("bench") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            create_node(api, work)
            for n in sizes:
                size = run_size(n, cluster, api, work, opts)
                markdown = report(size, info, opts, command)
                print("\n" + markdown, flush=True)
                if opts.write:
                    path = write_json(f"compare-{n}.json", to_json(size, info, opts, command))
                    log(f"wrote {path}")
                    (RESULTS_DIR / f"compare-{n}.md").write_text(markdown)
                    log(f"updated {update_latest(f'compare-{n}', markdown)}")
        finally:
            api.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
