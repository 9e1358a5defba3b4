"""Side by side: upstream kube-proxy v1.36.2 and the kpx agent, in nftables and iptables modes.

Against ONE local control plane (`bench-<pid>`), for each size N (default 1,000 then 10,000;
the workload grows from one size to the next) and each mode both implement:

1. the workload: N ClusterIP Services (one TCP port 80 -> 8080) and N EndpointSlices of 10
   ready endpoints (as bench/agent_scale.py), and the Node `bench-node-0` with an InternalIP
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
   - CPU (process + its children: nft, iptables-restore) and peak RSS (VmHWM) from /proc;
   - ruleset size (lines, chains, rules, set/map elements);
3. equivalence: the kernel's (Service IP, port) -> {endpoint IP:port} mappings of both
   systems, read back from full dumps (bench/ruleset_readback.py), compared with each other at
   the same apiserver state and with that state.

Usage: python3 bench/compare.py [--services N] [--modes nftables,iptables]
Writes bench/results/compare-<N>.json and compare-<N>.md (and its section of latest.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent_scale import (
    CLUSTER_CIDR,
    CREATE_CHUNK,
    ENDPOINTS_PER_SERVICE,
    NAMESPACE,
    NODE_SETTLE_SECONDS,
    SERVICE_PORT,
    TARGET_PORT,
    control_plane_cpu,
    endpoint_addresses,
    svc_name,
)
from benchlib import (
    RESULTS_DIR,
    ApiClient,
    LineHelper,
    bench_cluster,
    component_pid,
    endpoint_slice,
    endpoints,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    median,
    namespace,
    percentile,
    proc_cpu_seconds,
    proc_memory_kb,
    service,
    services_path,
    slices_path,
    update_latest,
    wait_until_quiet,
    write_json,
)
from kpx_cluster.binaries import KUBERNETES_VERSION, kubernetes_binary
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Topology
from ruleset_readback import (
    Comparison,
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

NODE_NAME = "bench-node-0"
NODE_IP = "10.242.0.1"  # the fabric address of a Topology's first node
METRICS_ADDRESS = "127.0.0.1:10249"
HEALTHZ_ADDRESS = "127.0.0.1:10256"
PROBE_HELPER = Path(__file__).resolve().parent / "kernel_probe.py"
DEFAULT_SIZES = (1000, 10000)
MODES = ("nftables", "iptables")
KUBE_PROXY, KPX = "kube-proxy", "kpx"
SYSTEMS = (KUBE_PROXY, KPX)
WORKERS = 8
SETTLE_SECONDS = 3.0
CHANGE_TIMEOUT = 120.0
DUMP_TIMEOUT = 900.0
# Pollers sleep at least twice as long as their last poll took, so they take at most a third
# of one core from the process measured (the machine has two); the resolution is reported.
MIN_POLL_SLEEP = 0.001


# ---- the workload ------------------------------------------------------------------------------


def changed_address(k: int) -> str:
    """Address of the k-th replacement endpoint (no original endpoint has it)."""
    return f"10.244.{200 + k // 250}.{k % 250 + 1}"


@dataclass
class Workload:
    """What the apiserver holds: every Service's VIP and its current endpoints."""

    vips: list[str] = field(default_factory=list)
    current: list[list[tuple[str, str]]] = field(default_factory=list)
    replaced: int = 0  # replacement addresses handed out
    creation: list[dict[str, Any]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.vips)

    def key(self, svc: int) -> Key:
        return (self.vips[svc], "tcp", SERVICE_PORT)

    def expected(self, n: int | None = None) -> Mappings:
        return {
            self.key(i): frozenset(f"{ip}:{TARGET_PORT}" for ip, _ in self.current[i])
            for i in range(self.size if n is None else n)
        }

    def replace_last(self, svc: int) -> tuple[str, str, tuple[str, dict[str, Any]]]:
        """Replace svc's last endpoint: (old 'IP:PORT', new 'IP:PORT', the PATCH to send)."""
        addrs = self.current[svc]
        old = addrs[-1][0]
        new = changed_address(self.replaced)
        self.replaced += 1
        addrs[-1] = (new, addrs[-1][1])
        patch = (slices_path(NAMESPACE, f"{svc_name(svc)}-1"), {"endpoints": endpoints(addrs)})
        return f"{old}:{TARGET_PORT}", f"{new}:{TARGET_PORT}", patch


def create_node(api: ApiClient) -> None:
    api.create("/api/v1/namespaces", namespace(NAMESPACE))
    api.create(
        "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME}}
    )
    api.request(
        "PATCH",
        f"/api/v1/nodes/{NODE_NAME}/status",
        {"status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}},
        "merge",
    )


def grow(cluster: Cluster, api: ApiClient, work: Workload, n: int) -> None:
    """Create Services and EndpointSlices size..n-1."""
    start = work.size
    if n <= start:
        return
    cpu0 = control_plane_cpu(cluster)
    t0 = time.monotonic()
    for lo in range(start, n, CREATE_CHUNK):
        chunk = range(lo, min(n, lo + CREATE_CHUNK))
        made = api.many(
            "POST", [(services_path(NAMESPACE), service(NAMESPACE, svc_name(i))) for i in chunk]
        )
        work.vips += [str(obj["spec"]["clusterIP"]) for obj in made]
        log(f"  services: {work.size}/{n}")
    services_s = time.monotonic() - t0
    t1 = time.monotonic()
    for lo in range(start, n, CREATE_CHUNK):
        chunk = range(lo, min(n, lo + CREATE_CHUNK))
        addrs = [endpoint_addresses(i) for i in chunk]
        api.many(
            "POST",
            [
                (slices_path(NAMESPACE), endpoint_slice(NAMESPACE, svc_name(i), a, TARGET_PORT))
                for i, a in zip(chunk, addrs, strict=True)
            ],
        )
        work.current += addrs
        log(f"  endpointslices: {chunk.stop}/{n}")
    cpu1 = control_plane_cpu(cluster)
    work.creation.append(
        {
            "from": start,
            "to": n,
            "services_s": round(services_s, 2),
            "slices_s": round(time.monotonic() - t1, 2),
            "control_plane_cpu_s": {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1},
        }
    )


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

    def argv(self, kubeconfig: Path) -> list[str]:
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
            "kpx_agent.cli",
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
        ]

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


def start(dp: Dataplane, topo: Topology, node: Node, cluster: Cluster, tag: str) -> Running:
    log_path = topo.tmpdir / f"{tag}.log"
    with log_path.open("wb") as out:
        started = time.monotonic()
        proc = topo.run(node, dp.argv(cluster.kubeconfig), stdout=out, stderr=subprocess.STDOUT)
    return Running(proc, log_path, started)


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


def metrics(topo: Topology, node: Node) -> dict[str, float]:
    """Sync-duration sums and counts from the process's /metrics (same names in both)."""
    url = f"http://{METRICS_ADDRESS}/metrics"
    proc = topo.exec(node, ["curl", "-s", "--max-time", "10", url])
    wanted = (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_network_programming_duration_seconds",
    )
    out: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(proc.stdout):
            if family.name not in wanted:
                continue
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{labels}}}"] = s.value
    return out


# ---- measurements ------------------------------------------------------------------------------


@dataclass
class ColdStart:
    seconds: float = 0.0  # process start -> the poll that saw all N ended
    confirmed_s: float = 0.0  # ... -> the full listing that confirmed them ended
    timed_out: bool = False
    polls: int = 0
    poll_ms: float = 0.0  # mean duration of one poll
    cpu_s: float = 0.0  # the process, at detection
    children_cpu_s: float = 0.0
    apiserver_cpu_s: float = 0.0


@dataclass
class Change:
    service: int
    latency_ms: float
    ack_ms: float
    polls: int


@dataclass
class Burst:
    size: int = 0
    latency_ms: float = 0.0  # first PATCH sent -> all `size` Services seen with the new endpoint
    sentinel_ms: float = 0.0  # ... -> the Service with the newest resourceVersion seen
    acked_ms: float = 0.0  # ... -> every PATCH acknowledged
    verified_ms: float = 0.0  # ... -> the pass that checked all of them ended
    passes: int = 0


@dataclass
class SystemResult:
    system: str
    mode: str
    colds: list[ColdStart] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    change_poll_ms: float = 0.0
    burst: Burst | None = None
    cpu_cold_s: float = 0.0  # process + children, at the last cold start's detection
    cpu_end_s: float = 0.0  # ... after changes and burst
    measured_s: float = 0.0  # last start -> end of the changes and burst
    peak_rss_mb: float = 0.0
    rss_end_mb: float = 0.0
    ruleset: dict[str, int] = field(default_factory=dict)  # at the end
    ruleset_cold: dict[str, int] = field(default_factory=dict)  # after the last cold start
    metrics: dict[str, float] = field(default_factory=dict)
    readback_s: list[float] = field(default_factory=list)
    # A stopped iptables kube-proxy: the size of the ruleset it was loading, from its log.
    ruleset_from_log: dict[str, int] = field(default_factory=dict)
    error: str = ""
    log_tail: str = ""

    @property
    def completed(self) -> list[float]:
        return [c.seconds for c in self.colds if not c.timed_out]

    @property
    def timed_out(self) -> bool:
        return any(c.timed_out for c in self.colds)

    def latencies(self) -> list[float]:
        return [c.latency_ms for c in self.changes]


@dataclass(frozen=True)
class Options:
    changes: int = 20
    burst: int = 100
    gap: float = 1.2
    cold_starts: int = 3
    cold_timeout: float = 600.0
    modes: tuple[str, ...] = MODES
    systems: tuple[str, ...] = SYSTEMS
    write: bool = True
    keep_dumps: Path | None = None  # save each system's final ruleset dumps under <N>/ here


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
        old, new, (path, body) = work.replace_last(svc)
        request = dp.endpoints_request(work.key(svc), chains[work.key(svc)])
        t0 = time.monotonic()
        api.merge_patch(path, body)
        acked = time.monotonic()
        seen, n, took = wait_visible(probe, request, old, new, t0, CHANGE_TIMEOUT)
        spent, polls = spent + took, polls + n
        result.changes.append(Change(svc, (seen - t0) * 1000, (acked - t0) * 1000, n))
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
        with Topology() as topo:
            exit_on_sigterm()  # unwind through this `with` and the control plane's `finally`
            node = topo.add_node(NODE_NAME)
            topo.expose_host_port(cluster.apiserver_port)
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
                run = start(dp, topo, node, cluster, f"{dp.system}-{dp.mode}-{i}")
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
    picks = rng.sample(range(work.size), min(work.size, opts.changes + opts.burst))
    log(f"{dp.label}: {opts.changes} single changes, one every >= {opts.gap:.1f} s")
    measure_changes(dp, probe, api, work, chains, run, picks[: opts.changes], opts.gap, result)
    lat = result.latencies()
    log(f"{dp.label}: change median {median(lat):.1f} ms, p90 {percentile(lat, 90):.1f} ms")
    if opts.burst:
        result.burst = measure_burst(dp, probe, api, work, chains, picks[opts.changes :])
        log(f"{dp.label}: burst of {opts.burst}: {result.burst.latency_ms:.0f} ms")
    own, children = tree_cpu(run.pid)
    result.cpu_end_s = own + children
    result.measured_s = time.monotonic() - run.started
    mem = proc_memory_kb(run.pid)
    result.peak_rss_mb = mem.get("VmHWM", 0) / 1024
    result.rss_end_mb = mem.get("VmRSS", 0) / 1024
    result.metrics = metrics(topo, node)
    run.check_alive()
    readback, took, dump = dp.readback(topo, node)
    result.readback_s.append(round(took, 2))
    reads.final = readback.mappings
    result.ruleset = dp.ruleset_size(topo, node, dump, keep)


# ---- one size ----------------------------------------------------------------------------------


@dataclass
class ModeResult:
    mode: str
    systems: dict[str, SystemResult] = field(default_factory=dict)
    equivalence: dict[str, Comparison] = field(default_factory=dict)


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


@dataclass
class SizeResult:
    services: int
    modes: dict[str, ModeResult]
    creation: list[dict[str, Any]]
    run_seconds: float
    load_average: tuple[float, float, float]


def run_size(
    n: int, cluster: Cluster, api: ApiClient, work: Workload, opts: Options, node_created: float
) -> SizeResult:
    started, load = time.monotonic(), os.getloadavg()
    log(f"=== {n:,} Services x {ENDPOINTS_PER_SERVICE} endpoints")
    before = len(work.creation)
    grow(cluster, api, work, n)
    time.sleep(max(0.0, node_created + NODE_SETTLE_SECONDS - time.monotonic()))
    modes = {mode: run_mode(mode, cluster, api, work, opts) for mode in opts.modes}
    return SizeResult(n, modes, work.creation[before:], time.monotonic() - started, load)


# ---- reporting ---------------------------------------------------------------------------------


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:,.0f} s"


def _ms(x: float) -> str:
    return f"{x:,.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _ratio(ours: float | None, theirs: float | None, theirs_lower_bound: bool = False) -> str:
    if ours is None or theirs is None or theirs <= 0:
        return "n/a"
    r = ours / theirs
    text = f"{r:.3f}" if r < 0.1 else f"{r:.2f}"
    if theirs_lower_bound:
        return f"< {text}"
    return f"**{text}**" if r > 1 else text


@dataclass(frozen=True)
class Figure:
    name: str
    value: Callable[[SystemResult], float | None]
    fmt: Callable[[float], str]


def _cold(r: SystemResult) -> float | None:
    return median(r.completed) if r.completed else None


def _p(q: float) -> Callable[[SystemResult], float | None]:
    def get(r: SystemResult) -> float | None:
        lat = r.latencies()
        return percentile(lat, q) if lat else None

    return get


def _burst(r: SystemResult) -> float | None:
    return r.burst.latency_ms if r.burst else None


def _mb(x: float) -> str:
    return f"{x:.0f} MB"


def _bytes(x: float) -> str:
    return f"{x / 1e6:.1f} MB"


def _count(x: float) -> str:
    return f"{x:,.0f}"


def _ruleset(key: str) -> Callable[[SystemResult], float | None]:
    """The ruleset at one apiserver state: kube-proxy's at its end, kpx's after its cold start
    (nothing changed in between; the element count depends on the state: endpoints shared by
    two Services stay in the hairpin set when one of them changes)."""

    def get(r: SystemResult) -> float | None:
        src = r.ruleset_cold if r.system == KPX and r.ruleset_cold else r.ruleset
        return float(src[key]) if key in src else None

    return get


def _cpu_changes(r: SystemResult) -> float | None:
    return r.cpu_end_s - r.cpu_cold_s if r.cpu_end_s else None


def figures(opts: Options, n_cold: int) -> list[Figure]:
    return [
        Figure(
            f"cold start: process start -> all N Services in the kernel (median of {n_cold})",
            _cold,
            _s,
        ),
        Figure(f"single change -> in the kernel, median of {opts.changes}", _p(50), _ms),
        Figure("single change, p90", _p(90), _ms),
        Figure(
            f"burst: {opts.burst} EndpointSlices changed at once -> all in the kernel", _burst, _ms
        ),
        Figure(
            "CPU, process + children (nft, iptables-restore): cold start",
            lambda r: r.cpu_cold_s or None,
            _s,
        ),
        Figure("CPU, process + children: the changes and the burst", _cpu_changes, _s),
        Figure("peak RSS of the process (VmHWM)", lambda r: r.peak_rss_mb or None, _mb),
        Figure(
            "ruleset: lines (`nft list ruleset`; iptables-save + ip6tables-save)",
            _ruleset("lines"),
            _count,
        ),
        Figure("ruleset: size of that listing", _ruleset("bytes"), _bytes),
        Figure("ruleset: chains", _ruleset("chains"), _count),
        Figure("ruleset: rules", _ruleset("rules"), _count),
        Figure("ruleset: set and map elements", _ruleset("elements"), _count),
    ]


def _cell(fig: Figure, r: SystemResult | None, timeout: float) -> tuple[str, float | None, bool]:
    """(text, value, value is a lower bound)."""
    if r is None:
        return "not run", None, False
    if r.timed_out and fig.value is _cold:
        limit = f"{timeout / 60:.0f} min" if timeout >= 120 else f"{timeout:.1f} s"
        return f"> {limit} (stopped)", timeout, True
    if r.timed_out and fig.name.startswith(("single", "burst", "CPU, process + children: the")):
        return "skipped (no cold start)", None, False
    if r.timed_out and fig.name.startswith(("CPU", "peak RSS")):
        value = fig.value(r)
        if value is not None:  # what it had used when stopped: a lower bound
            return f">= {fig.fmt(value)} (when stopped)", value, True
    if r.timed_out and fig.name.startswith("ruleset"):
        key = fig.name.split(": ")[1].split()[0]
        if key in r.ruleset_from_log:
            value = float(r.ruleset_from_log[key])
            return f"{fig.fmt(value)} (being loaded when stopped; IPv4, from its log)", value, False
        return "none committed", None, False
    value = fig.value(r)
    if value is None:
        return ("failed" if r.error else "n/a"), None, False
    return fig.fmt(value), value, False


def report(size: SizeResult, info: Mapping[str, str], opts: Options, command: str) -> str:
    n = size.services
    headers = ["figure"]
    for mode_name in size.modes:
        headers += [f"kube-proxy {mode_name}", f"kpx {mode_name}", "kpx / kube-proxy"]
    rows = []
    for fig in figures(opts, opts.cold_starts):
        row = [fig.name]
        for mode in size.modes.values():
            up_text, up, up_bound = _cell(fig, mode.systems.get(KUBE_PROXY), opts.cold_timeout)
            ours_text, ours, _ = _cell(fig, mode.systems.get(KPX), opts.cold_timeout)
            row += [up_text, ours_text, _ratio(ours, up, up_bound)]
        if any(c not in ("n/a", "not run") for c in row[1:]):
            rows.append(row)
    eq_row = ["equivalence (Service IP, port) -> endpoints, read back from the kernel"]
    for mode in size.modes.values():
        ok = mode.equivalence and all(c.equal for c in mode.equivalence.values())
        verdict = ("equal" if ok else "**see below**") if mode.equivalence else "n/a"
        if ok and not any(name.startswith(KUBE_PROXY) for name in mode.equivalence):
            verdict = "kpx = apiserver state (no kube-proxy ruleset to compare)"
        eq_row += ["", "", verdict]
    rows.append(eq_row)
    load = " / ".join(f"{x:.2f}" for x in size.load_average)
    text = (
        f"## kube-proxy {KUBERNETES_VERSION} vs kpx at {n:,} Services x "
        f"{ENDPOINTS_PER_SERVICE} endpoints\n\n"
        f"Machine: {machine_line(info)}. Command: `{command}`. "
        f"This size took {size.run_seconds / 60:.1f} min; load average when it started "
        f"(1/5/15 min): {load}.\n\n"
        + markdown_table(headers, rows)
        + "\nRatios are kpx / kube-proxy: below 1 means kpx is lower (better); **bold** means "
        "kpx is behind. Ruleset figures are taken at one apiserver state: kube-proxy's at the "
        "end of its run, kpx's right after its cold start (nothing changed in between).\n\n"
        + "\n".join(f"- {line}" for line in details(size, opts))
        + "\n"
    )
    return text


def details(size: SizeResult, opts: Options) -> list[str]:
    lines = []
    for made in size.creation:
        cpu = ", ".join(f"{k} {v:.1f} s" for k, v in made["control_plane_cpu_s"].items())
        lines.append(
            f"Created Services {made['from']:,}..{made['to'] - 1:,} in {made['services_s']:.1f} s "
            f"and their EndpointSlices in {made['slices_s']:.1f} s ({cpu} of control-plane CPU)."
        )
    for mode, m in size.modes.items():
        for system, r in m.systems.items():
            label = f"{system} {mode}"
            colds = ", ".join(
                ("stopped at " if c.timed_out else "") + _s(c.seconds) for c in r.colds
            )
            parts = [f"**{label}**: cold starts {colds or 'none'}"]
            done = [c for c in r.colds if not c.timed_out]
            if done:
                cold = done[-1]
                parts.append(
                    f" (last: confirmed by a full listing at {_s(cold.confirmed_s)}; "
                    f"{cold.polls} polls of {cold.poll_ms:.1f} ms; apiserver CPU "
                    f"{cold.apiserver_cpu_s:.2f} s)"
                )
            lat = r.latencies()
            if lat:
                parts.append(
                    f"; changes min {_ms(min(lat))} / median {_ms(median(lat))} / p90 "
                    f"{_ms(percentile(lat, 90))} / max {_ms(max(lat))} (PATCH acknowledged in "
                    f"{median([c.ack_ms for c in r.changes]):.1f} ms median; one kernel poll "
                    f"{r.change_poll_ms:.2f} ms)"
                )
            if r.burst:
                b = r.burst
                parts.append(
                    f"; burst: all {b.size} PATCHes acknowledged at {_ms(b.acked_ms)}, newest "
                    f"write in the kernel at {_ms(b.sentinel_ms)}, all {b.size} checked by "
                    f"{_ms(b.verified_ms)} ({b.passes} pass(es))"
                )
            if r.measured_s:
                parts.append(
                    f"; CPU {r.cpu_cold_s:.2f} s at cold start, {r.cpu_end_s:.2f} s after "
                    f"{r.measured_s:.0f} s running; RSS at the end {r.rss_end_mb:.0f} MB"
                )
            sync = _sync_summary(r.metrics)
            if sync:
                parts.append(f"; own metrics: {sync}")
            if r.readback_s:
                parts.append(
                    f"; full dumps for the read-back took {', '.join(_s(x) for x in r.readback_s)}"
                )
            if r.error:
                parts.append(f"; **error**: {r.error.splitlines()[0]}")
            lines.append("".join(parts) + ".")
        for name, comparison in m.equivalence.items():
            lines.append(f"Equivalence ({mode}): {name}: {comparison.summary()}.")
        upstream = m.systems.get(KUBE_PROXY)
        if upstream is not None and upstream.timed_out:
            lines.append(
                f"Equivalence ({mode}): kube-proxy never completed its first sync, so kpx is "
                "compared with the apiserver's state only."
            )
    return lines


def _sync_summary(m: Mapping[str, float]) -> str:
    out = []
    for kind in ("full", "partial"):
        total = sum(
            v
            for k, v in m.items()
            if k.startswith(f"kubeproxy_sync_{kind}_proxy_rules_duration_seconds_sum")
        )
        count = sum(
            v
            for k, v in m.items()
            if k.startswith(f"kubeproxy_sync_{kind}_proxy_rules_duration_seconds_count")
        )
        if count:
            out.append(f"{count:.0f} {kind} syncs, {total / count:.3f} s mean")
    if not out:
        total = sum(
            v
            for k, v in m.items()
            if k.startswith("kubeproxy_sync_proxy_rules_duration_seconds_sum")
        )
        count = sum(
            v
            for k, v in m.items()
            if k.startswith("kubeproxy_sync_proxy_rules_duration_seconds_count")
        )
        if count:
            out.append(f"{count:.0f} syncs, {total / count:.3f} s mean")
    return ", ".join(out)


def to_json(
    size: SizeResult, info: Mapping[str, str], opts: Options, command: str
) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode, m in size.modes.items():
        systems: dict[str, Any] = {}
        for system, r in m.systems.items():
            data = asdict(r)
            lat = r.latencies()
            data["summary"] = {
                "cold_start_s": _cold(r),
                "cold_start_timed_out": r.timed_out,
                "change_median_ms": median(lat) if lat else None,
                "change_p90_ms": percentile(lat, 90) if lat else None,
                "burst_ms": r.burst.latency_ms if r.burst else None,
                "cpu_cold_s": r.cpu_cold_s,
                "cpu_changes_s": _cpu_changes(r),
                "peak_rss_mb": r.peak_rss_mb,
            }
            systems[system] = data
        modes[mode] = {
            "systems": systems,
            "equivalence": {
                name: {
                    "equal": c.equal,
                    "compared": c.compared,
                    "missing_left": [list(k) for k in c.missing_left[:100]],
                    "missing_right": [list(k) for k in c.missing_right[:100]],
                    "different": [list(k) for k in c.different[:100]],
                    "counts": [len(c.missing_left), len(c.missing_right), len(c.different)],
                    "examples": c.examples,
                    "summary": c.summary(),
                }
                for name, c in m.equivalence.items()
            },
        }
    return {
        "benchmark": "compare",
        "command": command,
        "services": size.services,
        "endpoints_per_service": ENDPOINTS_PER_SERVICE,
        "machine": dict(info),
        "options": {**asdict(opts), "keep_dumps": str(opts.keep_dumps or "") or None},
        "creation": size.creation,
        "run_seconds": round(size.run_seconds, 1),
        "load_average": size.load_average,
        "modes": modes,
    }


# ---- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, help="run only this size (default: 1000, 10000)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    parser.add_argument("--changes", type=int, default=20, help="single changes to time")
    parser.add_argument("--burst", type=int, default=100, help="EndpointSlices in the burst")
    parser.add_argument("--gap", type=float, default=1.2, help="seconds between changes")
    parser.add_argument("--cold-starts", type=int, default=3, help="cold starts per system")
    parser.add_argument(
        "--cold-timeout", type=float, default=600.0, help="seconds before a cold start is stopped"
    )
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
            create_node(api)
            node_created = time.monotonic()
            for n in sizes:
                size = run_size(n, cluster, api, work, opts, node_created)
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
