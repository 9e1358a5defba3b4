"""What leaving namespaces out saves: the agent, the apiserver and the kernel, at N Services.

Against ONE local control plane: N ClusterIP Services with an EndpointSlice of 10 endpoints
each (bench/workload.py's), half in the namespace `bench`, half in `bench-out`. Each proxy is
started alone in a fresh node netns, nftables mode, in turn:

1. nothing left out: kpx, then upstream kube-proxy v1.36.2 (both proxy all N);
2. `bench-out` labelled `networking.k8s.io/kube-proxy=disabled`: kpx (its namespace opt-out,
   an exclusion field selector on its watches; upstream has no such thing);
3. the label removed, and every Service and EndpointSlice of `bench-out` labelled
   `service.kubernetes.io/service-proxy-name=elsewhere` instead (upstream's way of leaving a
   Service to another proxy; the EndpointSlice controller copies a Service's labels to its
   slices): kpx, then kube-proxy.

For each: cold start (process start -> every proxied Service in the kernel; the left-out half
checked absent from the kernel), peak RSS (VmHWM) and CPU (process and children) once synced,
what the apiserver sent for the initial lists and watches (the deltas of its
`apiserver_response_sizes` for LIST and `apiserver_watch_events_sizes`, Services and
EndpointSlices) and the apiserver's CPU meanwhile; then what one change in `bench-out` costs:
K EndpointSlice updates there, the watch bytes the apiserver sent (less what it sends with no
proxy running: the controller-manager's own watches) and the proxy's CPU, per change.

Usage: python3 bench/optout_savings.py [--services N] [--changes K] [--no-write]
Writes bench/results/optout-<N>.json and .md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchlib import (
    RESULTS_DIR,
    ApiClient,
    bench_cluster,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    namespace,
    proc_memory_kb,
    services_path,
    slices_path,
    write_json,
)
from compare import (
    KPX,
    KUBE_PROXY,
    WORKERS,
    Dataplane,
    Probe,
    node_netns,
    start,
    tree_cpu,
    wait_cold_start,
)
from kpx_cluster.controlplane import Cluster
from workload import Workload, control_plane_cpu, create_node, grow, svc_name

OUT_NAMESPACE = "bench-out"
OPT_OUT_LABEL = "networking.k8s.io/kube-proxy"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
RESOURCES = ("services", "endpointslices")
COLD_TIMEOUT = 900.0
SETTLE_SECONDS = 3.0  # after the cold start: the first sync's verification
CHANGE_SETTLE_SECONDS = 3.0  # after the last change: every watch event sent


@dataclass
class Run:
    setup: str
    proxy: str
    proxied: int
    cold_s: float = 0.0  # timing: depends on the machine's load
    left_out_in_kernel: int = 0  # Services of bench-out the kernel holds (must be 0 when left out)
    peak_mb: float = 0.0
    cpu_s: float = 0.0  # process + children, at SETTLE_SECONDS after the cold start
    list_bytes: dict[str, float] = field(default_factory=dict)
    watch_bytes: dict[str, float] = field(default_factory=dict)
    apiserver_cpu_s: float = 0.0
    change_watch_bytes: float = 0.0  # per change in bench-out, the controller-manager's taken off
    change_cpu_ms: float = 0.0  # the proxy's CPU per change in bench-out
    error: str = ""

    @property
    def initial_bytes(self) -> float:
        return sum(self.list_bytes.values()) + sum(self.watch_bytes.values())


def sent_bytes(cluster: Cluster) -> tuple[dict[str, float], dict[str, float]]:
    """What the apiserver has sent so far for Services and EndpointSlices: the sums of its LIST
    response sizes and of its watch event sizes, per resource."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    lists = dict.fromkeys(RESOURCES, 0.0)
    watches = dict.fromkeys(RESOURCES, 0.0)
    kinds = {"Service": "services", "EndpointSlice": "endpointslices"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "apiserver_response_sizes_sum" and s.labels.get("verb") == "LIST":
                resource = s.labels.get("resource", "")
                if resource in lists:
                    lists[resource] += s.value
            elif s.name == "apiserver_watch_events_sizes_sum":
                resource = s.labels.get("resource") or kinds.get(s.labels.get("kind", ""), "")
                if resource in watches:
                    watches[resource] += s.value
    return lists, watches


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def change_out(api: ApiClient, out: Workload, k: int) -> None:
    """K EndpointSlice updates in bench-out, one Service's last endpoint replaced each."""
    for i in range(k):
        _old, _new, (path, patch) = out.replace_last(i % out.size)
        api.merge_patch(path, patch)


def measure(
    cluster: Cluster,
    api: ApiClient,
    setup: str,
    dp: Dataplane,
    proxied: Workload,
    out: Workload,
    changes: int,
    idle_change_bytes: float,
) -> Run:
    """One proxy's run; `out`'s Services are left out unless `proxied` holds them."""
    result = Run(setup, dp.label, proxied.size)
    left_out = None if out.vips[0] in proxied.vips else out
    lists0, watches0 = sent_bytes(cluster)
    cpu0 = control_plane_cpu(cluster).get("kube-apiserver", 0.0)
    with node_netns(cluster) as (topo, node):
        probe = Probe(topo, node)
        run = None
        try:
            tag = f"optout-{dp.system}-{setup.split()[0]}"
            run = start(dp, topo, node, cluster, tag)
            cold, chains = wait_cold_start(dp, probe, run, topo, node, proxied, COLD_TIMEOUT)
            if cold.timed_out:
                raise TimeoutError(f"not every proxied Service in the kernel in {COLD_TIMEOUT} s")
            result.cold_s = round(cold.seconds, 2)
            if left_out is not None:
                result.left_out_in_kernel = len(set(left_out.expected()) & set(chains))
            time.sleep(SETTLE_SECONDS)
            own, children = tree_cpu(run.pid)
            result.cpu_s = round(own + children, 2)
            result.peak_mb = round(proc_memory_kb(run.pid).get("VmHWM", 0) / 1024, 1)
            lists1, watches1 = sent_bytes(cluster)
            result.apiserver_cpu_s = round(
                control_plane_cpu(cluster).get("kube-apiserver", 0.0) - cpu0, 2
            )
            result.list_bytes = _delta(lists1, lists0)
            result.watch_bytes = _delta(watches1, watches0)
            # The proxy's CPU over a window with the changes, less an idle window as long.
            cpu_a = sum(tree_cpu(run.pid))
            t0 = time.monotonic()
            change_out(api, out, changes)
            time.sleep(CHANGE_SETTLE_SECONDS)
            window = time.monotonic() - t0
            cpu_b = sum(tree_cpu(run.pid))
            _, watches2 = sent_bytes(cluster)
            time.sleep(window)
            idle_cpu = sum(tree_cpu(run.pid)) - cpu_b
            sent = sum(_delta(watches2, watches1).values())
            result.change_watch_bytes = round(max(0.0, sent / changes - idle_change_bytes), 1)
            busy = max(0.0, (cpu_b - cpu_a) - idle_cpu)
            result.change_cpu_ms = round(busy / changes * 1e3, 2)
            log(
                f"{setup}, {dp.label}: {proxied.size:,} proxied, cold start {result.cold_s} s, "
                f"peak {result.peak_mb} MB, CPU {result.cpu_s} s, initial "
                f"{result.initial_bytes / 1e6:.1f} MB sent, apiserver CPU "
                f"{result.apiserver_cpu_s} s; per change in {OUT_NAMESPACE}: "
                f"{result.change_watch_bytes:.0f} B, {result.change_cpu_ms} ms CPU"
            )
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"{setup}, {dp.label}: FAILED: {result.error}")
            if run is not None:
                log(run.log_tail())
        finally:
            probe.close()
            if run is not None:
                run.stop()
    return result


def idle_watch_bytes(cluster: Cluster, api: ApiClient, out: Workload, changes: int) -> float:
    """Watch bytes per change in bench-out with no proxy running (the controller-manager's)."""
    _, before = sent_bytes(cluster)
    change_out(api, out, changes)
    time.sleep(CHANGE_SETTLE_SECONDS)
    _, after = sent_bytes(cluster)
    return sum(_delta(after, before).values()) / changes


def label_out(api: ApiClient, out: Workload, value: str | None) -> None:
    """Set (or with None remove) the service-proxy-name label on bench-out's Services and
    EndpointSlices."""
    patch = {"metadata": {"labels": {PROXY_NAME_LABEL: value}}}
    names = [svc_name(i) for i in range(out.size)]
    api.many("PATCH", [(f"{services_path(OUT_NAMESPACE)}/{n}", patch) for n in names])
    api.many("PATCH", [(slices_path(OUT_NAMESPACE, f"{n}-1"), patch) for n in names])


def report(n: int, runs: list[Run], info: Mapping[str, str], changes: int, idle: float) -> str:
    def mb(value: float) -> str:
        return f"{value / 1e6:,.1f} MB"

    rows = []
    for r in runs:
        if r.error:
            rows.append([r.setup, r.proxy, f"{r.proxied:,}", f"failed: {r.error[:120]}"])
            continue
        rows.append(
            [
                r.setup,
                r.proxy,
                f"{r.proxied:,}",
                f"{r.cold_s:.2f} s",
                f"{r.peak_mb:.0f} MB",
                f"{r.cpu_s:.2f} s",
                mb(sum(r.list_bytes.values())),
                mb(sum(r.watch_bytes.values())),
                f"{r.apiserver_cpu_s:.2f} s",
                f"{r.change_watch_bytes:,.0f} B / {r.change_cpu_ms:.1f} ms",
                str(r.left_out_in_kernel),
            ]
        )
    headers = [
        "setup",
        "proxy (nftables)",
        "Services proxied",
        "cold start",
        "peak RSS",
        "CPU at cold start",
        "initial LIST bytes",
        "initial watch bytes",
        "apiserver CPU (initial)",
        f"per change in {OUT_NAMESPACE}: watch bytes / proxy CPU",
        "left-out Services in the kernel",
    ]
    return (
        f"# Namespace opt-out savings at {n:,} Services\n\n"
        f"Machine: {machine_line(info)}. Command: `python3 bench/optout_savings.py --services "
        f"{n}`. Half the Services (x 10 endpoints) in `{OUT_NAMESPACE}`; per-change figures from "
        f"{changes} EndpointSlice updates there (with no proxy running the apiserver sent "
        f"{idle:,.0f} watch bytes per update, taken off; the proxy's CPU in an idle window as "
        "long, taken off). Method: bench/optout_savings.py's docstring, "
        "docs/benchmarks.md.\n\n" + markdown_table(headers, rows) + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=30000, help="Services in all")
    parser.add_argument("--changes", type=int, default=50, help="updates in bench-out")
    parser.add_argument("--systems", default=f"{KPX},{KUBE_PROXY}", help="comma-separated")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    systems = args.systems.split(",")
    n = args.services
    exit_on_sigterm()
    info = machine_info()
    runs: list[Run] = []
    idle = 0.0
    with bench_cluster("optout") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            inside, out = Workload(), Workload(namespace=OUT_NAMESPACE)
            create_node(api, inside)
            api.create("/api/v1/namespaces", namespace(OUT_NAMESPACE))
            grow(cluster, api, inside, n // 2)
            grow(cluster, api, out, n - n // 2)
            everything = Workload(vips=inside.vips + out.vips, current=inside.current + out.current)
            inside.settle_node()
            idle = idle_watch_bytes(cluster, api, out, args.changes)
            log(f"with no proxy: {idle:.0f} watch bytes per change in {OUT_NAMESPACE}")

            def each(setup: str, proxied: Workload, which: tuple[str, ...]) -> None:
                for system in which:
                    if system in systems:
                        dp = Dataplane(system, "nftables")
                        runs.append(
                            measure(cluster, api, setup, dp, proxied, out, args.changes, idle)
                        )

            each("nothing left out", everything, (KPX, KUBE_PROXY))
            ns_path = f"/api/v1/namespaces/{OUT_NAMESPACE}"
            api.merge_patch(ns_path, {"metadata": {"labels": {OPT_OUT_LABEL: "disabled"}}})
            each("namespace opt-out (label)", inside, (KPX,))
            api.merge_patch(ns_path, {"metadata": {"labels": {OPT_OUT_LABEL: None}}})
            label_out(api, out, "elsewhere")
            each("service-proxy-name label", inside, (KPX, KUBE_PROXY))
        finally:
            api.close()
    text = report(n, runs, info, args.changes, idle)
    print(text)
    if not args.no_write:
        data: dict[str, Any] = {
            "benchmark": "optout_savings",
            "machine": info,
            "services": n,
            "changes": args.changes,
            "idle_change_watch_bytes": round(idle, 1),
            "runs": [asdict(r) for r in runs],
        }
        write_json(f"optout-{n}.json", data)
        (RESULTS_DIR / f"optout-{n}.md").write_text(text)
    return 1 if any(r.error or r.left_out_in_kernel for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
