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
the bytes over the proxy's apiserver connection until then (the node netns's loopback
counter: the harness's relay carries the TLS stream there, so these are the bytes on the
wire, compressed where the apiserver compresses), the LISTs of Services and EndpointSlices the
apiserver answered meanwhile (requests, response bytes: its `apiserver_response_sizes`) and
the apiserver's CPU; then what an update in `bench-out` costs: K EndpointSlice updates there,
the bytes over the connection and the proxy's CPU, each less an idle window as long.

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
    wait_until_quiet,
    write_json,
)
from compare import (
    KPX,
    KUBE_PROXY,
    WORKERS,
    Dataplane,
    measuring,
    start,
    tree_cpu,
    wait_cold_start,
)
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Topology
from workload import Workload, control_plane_cpu, create_node, grow, svc_name

OUT_NAMESPACE = "bench-out"
OPT_OUT_LABEL = "networking.k8s.io/kube-proxy"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
RESOURCES = ("services", "endpointslices")
COLD_TIMEOUT = 900.0
QUIET_LIMIT = 180.0  # seconds to wait for an idle machine before each run
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
    initial_bytes: int = 0  # over the proxy's apiserver connection, both ways, TLS included
    list_requests: dict[str, float] = field(default_factory=dict)  # Services, EndpointSlices
    list_bytes: dict[str, float] = field(default_factory=dict)  # the apiserver's LIST responses
    apiserver_cpu_s: float = 0.0
    change_bytes: float = 0.0  # per change in bench-out, over the apiserver connection
    change_cpu_ms: float = 0.0  # the proxy's CPU per change in bench-out
    error: str = ""


def list_metrics(cluster: Cluster) -> tuple[dict[str, float], dict[str, float]]:
    """The apiserver's LISTs of Services and EndpointSlices so far: (requests, response bytes)
    per resource, from its `apiserver_response_sizes` histogram."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    counts = dict.fromkeys(RESOURCES, 0.0)
    sizes = dict.fromkeys(RESOURCES, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("apiserver_response_sizes_"):
                continue
            resource = s.labels.get("resource", "")
            if s.labels.get("verb") != "LIST" or resource not in counts:
                continue
            if s.name.endswith("_count"):
                counts[resource] += s.value
            elif s.name.endswith("_sum"):
                sizes[resource] += s.value
    return counts, sizes


def loopback_bytes(topo: Topology, node: Node) -> int:
    """Bytes through the node netns's loopback: the proxy reaches the apiserver there (a relay
    on 127.0.0.1 carries the TLS stream to the host), and nothing else talks on it."""
    out = topo.exec(node, ["cat", "/sys/class/net/lo/statistics/rx_bytes"], check=True)
    return int(out.stdout)


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
) -> Run:
    """One proxy's run; `out`'s Services are left out unless `proxied` holds them."""
    result = Run(setup, dp.label, proxied.size)
    left_out = None if out.vips[0] in proxied.vips else out
    # The apiserver and the controller-manager idle first (a relabelling's tail ends).
    wait_until_quiet(limit=QUIET_LIMIT)
    counts0, sizes0 = list_metrics(cluster)
    cpu0 = control_plane_cpu(cluster).get("kube-apiserver", 0.0)

    def fail(error: str) -> None:
        result.error = error

    with measuring(cluster, f"{setup}, {dp.label}", fail) as session:
        topo, node, probe = session.topo, session.node, session.probe
        lo0 = loopback_bytes(topo, node)
        tag = f"optout-{dp.system}-{setup.split()[0]}"
        run = session.run = start(dp, topo, node, cluster, tag)
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
        lo1 = loopback_bytes(topo, node)
        result.initial_bytes = lo1 - lo0
        counts1, sizes1 = list_metrics(cluster)
        result.apiserver_cpu_s = round(
            control_plane_cpu(cluster).get("kube-apiserver", 0.0) - cpu0, 2
        )
        result.list_requests = _delta(counts1, counts0)
        result.list_bytes = _delta(sizes1, sizes0)
        # Bytes and the proxy's CPU over a window with the changes, less an idle window
        # as long (watch bookmarks, periodic work).
        cpu_a, lo_a = sum(tree_cpu(run.pid)), loopback_bytes(topo, node)
        t0 = time.monotonic()
        change_out(api, out, changes)
        time.sleep(CHANGE_SETTLE_SECONDS)
        window = time.monotonic() - t0
        cpu_b, lo_b = sum(tree_cpu(run.pid)), loopback_bytes(topo, node)
        time.sleep(window)
        cpu_c, lo_c = sum(tree_cpu(run.pid)), loopback_bytes(topo, node)
        busy = max(0.0, (cpu_b - cpu_a) - (cpu_c - cpu_b))
        result.change_cpu_ms = round(busy / changes * 1e3, 2)
        sent = max(0, (lo_b - lo_a) - (lo_c - lo_b))
        result.change_bytes = round(sent / changes, 1)
        log(
            f"{setup}, {dp.label}: {proxied.size:,} proxied, cold start {result.cold_s} s, "
            f"peak {result.peak_mb} MB, CPU {result.cpu_s} s, "
            f"{result.initial_bytes / 1e6:.1f} MB over the apiserver connection, LISTs "
            f"{result.list_requests}, apiserver CPU {result.apiserver_cpu_s} s; per change "
            f"in {OUT_NAMESPACE}: {result.change_bytes:.0f} B, {result.change_cpu_ms} ms CPU"
        )
    return result


def label_out(api: ApiClient, out: Workload, value: str | None) -> None:
    """Set (or with None remove) the service-proxy-name label on bench-out's Services and
    EndpointSlices."""
    patch = {"metadata": {"labels": {PROXY_NAME_LABEL: value}}}
    names = [svc_name(i) for i in range(out.size)]
    api.many("PATCH", [(f"{services_path(OUT_NAMESPACE)}/{n}", patch) for n in names])
    api.many("PATCH", [(slices_path(OUT_NAMESPACE, f"{n}-1"), patch) for n in names])


#: LISTs of Services and EndpointSlices a proxy makes at its start (one each); more in a run's
#: window are another client's (the controller-manager's periodic ones), whose apiserver CPU
#: the run's figure then includes.
OWN_LISTS = 2


def report(n: int, runs: list[Run], info: Mapping[str, str], changes: int) -> str:
    def mb(value: float) -> str:
        return f"{value / 1e6:,.1f} MB"

    rows = []
    for r in runs:
        if r.error:
            rows.append([r.setup, r.proxy, f"{r.proxied:,}", f"failed: {r.error[:120]}"])
            continue
        other = sum(r.list_requests.values()) > OWN_LISTS
        # kube-proxy's syncs at this size outlast the window: its CPU per update is not read.
        cpu = f"{r.change_cpu_ms:.1f} ms" if r.proxy.startswith(KPX) else "not read"
        rows.append(
            [
                r.setup,
                r.proxy,
                f"{r.proxied:,}",
                f"{r.cold_s:.2f} s",
                f"{r.peak_mb:.0f} MB",
                f"{r.cpu_s:.2f} s",
                mb(r.initial_bytes),
                f"{r.apiserver_cpu_s:.2f} s{' *' if other else ''}",
                f"{r.change_bytes:,.0f} B / {cpu}",
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
        "bytes over its apiserver connection to cold start",
        "apiserver CPU meanwhile",
        f"per update in {OUT_NAMESPACE}: bytes / proxy CPU",
        "left-out Services in the kernel",
    ]
    return (
        f"# Namespace opt-out savings at {n:,} Services\n\n"
        f"Machine: {machine_line(info)}. Command: `python3 bench/optout_savings.py --services "
        f"{n}`. Half the Services (x 10 endpoints) in `{OUT_NAMESPACE}`; per-update figures from "
        f"{changes} EndpointSlice updates there (less an idle window as long). Method: "
        "bench/optout_savings.py's docstring, docs/benchmarks.md.\n\n"
        + markdown_table(headers, rows)
        + "\n\n\\* the window also held another client's LIST of Services (the apiserver's "
        "LIST count and response bytes are in the JSON).\n"
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

            def each(setup: str, proxied: Workload, which: tuple[str, ...]) -> None:
                for system in which:
                    if system in systems:
                        dp = Dataplane(system, "nftables")
                        runs.append(measure(cluster, api, setup, dp, proxied, out, args.changes))

            each("nothing left out", everything, (KPX, KUBE_PROXY))
            ns_path = f"/api/v1/namespaces/{OUT_NAMESPACE}"
            api.merge_patch(ns_path, {"metadata": {"labels": {OPT_OUT_LABEL: "disabled"}}})
            each("namespace opt-out (label)", inside, (KPX,))
            api.merge_patch(ns_path, {"metadata": {"labels": {OPT_OUT_LABEL: None}}})
            label_out(api, out, "elsewhere")
            each("service-proxy-name label", inside, (KPX, KUBE_PROXY))
        finally:
            api.close()
    text = report(n, runs, info, args.changes)
    print(text)
    if not args.no_write:
        data: dict[str, Any] = {
            "benchmark": "optout_savings",
            "machine": info,
            "services": n,
            "changes": args.changes,
            "runs": [asdict(r) for r in runs],
        }
        write_json(f"optout-{n}.json", data)
        (RESULTS_DIR / f"optout-{n}.md").write_text(text)
    return 1 if any(r.error or r.left_out_in_kernel for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
