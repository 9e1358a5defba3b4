"""Where the nftables agent's memory goes: its layers, measured in one process.

In a fresh network namespace (the real kernel takes the rules), an agent's store, node-local
model and nftables backend hold N Services, each with one port and E endpoints (E in one
EndpointSlice), built from objects shaped as the apiserver sends them (labels, annotations,
managedFields-free metadata, endpoints with targetRef, nodeName and the three conditions). It
reports, for each size:

- RSS after the agent's imports (`import kpx_agent.cli`), before any object;
- the bytes each layer holds after the first full sync (tracemalloc, by the file that
  allocated them): the store (store/), the node-local model and the sync's bookkeeping
  (model/, sync/), the nftables backend's record of what it programmed (backends/);
- RSS after the first full sync, measured in a second run without tracemalloc (which costs
  memory of its own);

then the slopes (least squares): bytes per Service (E fixed) and per endpoint (N fixed).

This is the agent's steady state without the apiserver: the list bodies a cold start or a
relist decodes come on top (bench/agent_memory.py measures the whole agent, a relist included).

Usage: python3 bench/memory_layers.py [--services 1000,10000,30000] [--endpoints 10]
       [--endpoint-sizes 1,10,50 --at 10000]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tracemalloc
import uuid
from collections.abc import Iterator, Sequence
from ipaddress import ip_network
from typing import Any

from scratch_netns import run_in_scratch_netns

LAYERS = (
    ("store", ("/kpx_agent/store/",)),
    ("model", ("/kpx_agent/model/", "/kpx_agent/sync/")),
    ("backend", ("/kpx_agent/backends/",)),
)


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def service(i: int) -> dict[str, Any]:
    ip = f"10.{96 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"
    return {
        "metadata": {
            "namespace": f"ns-{i % 100}",
            "name": f"svc-{i}",
            "uid": str(uuid.UUID(int=i)),
            "resourceVersion": str(1000 + i),
            "creationTimestamp": "2026-11-27T00:00:00Z",
            "labels": {"app": f"app-{i}", "tier": "backend"},
            "annotations": {"owner": "team-a"},
        },
        "spec": {
            "clusterIP": ip,
            "clusterIPs": [ip],
            "type": "ClusterIP",
            "selector": {"app": f"app-{i}"},
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "sessionAffinity": "None",
            "internalTrafficPolicy": "Cluster",
        },
        "status": {"loadBalancer": {}},
    }


def endpoint_slice(i: int, endpoints: int) -> dict[str, Any]:
    def address(k: int) -> str:
        n = i * endpoints + k
        return f"10.{128 + n // 62500 % 64}.{n // 250 % 250}.{n % 250 + 1}"

    return {
        "metadata": {
            "namespace": f"ns-{i % 100}",
            "name": f"svc-{i}-abcde",
            "uid": str(uuid.UUID(int=10**9 + i)),
            "resourceVersion": str(2000 + i),
            "creationTimestamp": "2026-11-27T00:00:00Z",
            "labels": {
                "kubernetes.io/service-name": f"svc-{i}",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
            "annotations": {
                "endpoints.kubernetes.io/last-change-trigger-time": "2026-11-27T00:00:00Z"
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [address(k)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": f"node-{k % 50}",
                "targetRef": {
                    "kind": "Pod",
                    "namespace": f"ns-{i % 100}",
                    "name": f"app-{i}-{k}",
                    "uid": str(uuid.UUID(int=10**12 + i * endpoints + k)),
                },
            }
            for k in range(endpoints)
        ],
    }


def inner(n: int, endpoints: int, trace: bool) -> dict[str, Any]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import kpx_agent.cli  # noqa: F401  (what the agent process imports)

    gc.collect()
    out: dict[str, Any] = {"imports_kb": rss_kb()}
    from kpx_agent.backends.nftables.backend import NftablesBackend
    from kpx_agent.model.types import DataplaneSettings
    from kpx_agent.observability.metrics import AgentMetrics
    from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
    from kpx_agent.sync.proxier import Proxier
    from kpx_api.proxysettings import NamespaceOptOut

    settings = DataplaneSettings(cluster_cidrs=(ip_network("10.128.0.0/10"),))
    if trace:
        tracemalloc.start(1)
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    for i in range(n):
        state.upsert(SERVICES, service(i))
        state.upsert(SLICES, endpoint_slice(i, endpoints))
    backend = NftablesBackend(settings)
    proxier = Proxier(
        state, backend, "bench-node-0", NamespaceOptOut(), AgentMetrics(), backend.settings
    )
    proxier.delete_flows = lambda _filters: 0
    outcome = proxier.sync()
    if not (outcome.ok and outcome.full):
        raise RuntimeError(f"first sync: {outcome.error}")
    gc.collect()
    if trace:
        layers = dict.fromkeys([name for name, _ in LAYERS] + ["other"], 0)
        for stat in tracemalloc.take_snapshot().statistics("filename"):
            path = stat.traceback[0].filename
            name = next((n for n, parts in LAYERS if any(p in path for p in parts)), "other")
            layers[name] += stat.size
        out["layers"] = layers
        tracemalloc.stop()
    else:
        out["synced_kb"] = rss_kb()
    backend.cleanup()
    return out


def measure(n: int, endpoints: int, trace: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--inner", str(n), str(endpoints)]
    out = run_in_scratch_netns("kpxmem", argv + (["--trace"] if trace else []))
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def slope(points: Sequence[tuple[float, float]]) -> float:
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def rows(sizes: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    for n, e in sizes:
        traced = measure(n, e, True)
        plain = measure(n, e, False)
        yield n, e, {**plain, "layers": traced["layers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="1000,10000,30000")
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--endpoint-sizes", default="1,10,50")
    parser.add_argument("--at", type=int, default=10000, help="Services for --endpoint-sizes")
    parser.add_argument("--inner", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(inner(args.inner[0], args.inner[1], args.trace)), flush=True)
        return
    by_services = [(int(n), args.endpoints) for n in args.services.split(",") if n]
    by_endpoints = [(args.at, int(e)) for e in args.endpoint_sizes.split(",") if e]
    sizes = list(dict.fromkeys(by_services + by_endpoints))
    print(
        "| Services x endpoints | RSS after imports | store | model | backend record | "
        "other | RSS after the first sync |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    results: dict[tuple[int, int], dict[str, Any]] = {}
    for n, e, r in rows(sizes):
        results[(n, e)] = r
        mb = {k: v / 1e6 for k, v in r["layers"].items()}
        print(
            f"| {n:,} x {e} | {r['imports_kb'] / 1000:.0f} MB | {mb['store']:.1f} MB | "
            f"{mb['model']:.1f} MB | {mb['backend']:.1f} MB | {mb['other']:.1f} MB | "
            f"{r['synced_kb'] / 1000:.0f} MB |",
            flush=True,
        )
    print()
    for label, points, unit in (
        (f"per Service (x {args.endpoints} endpoints)", by_services, "Service"),
        (f"per endpoint (at {args.at:,} Services)", by_endpoints, "endpoint"),
    ):
        if len(points) < 2:
            continue
        # x: Services (E fixed), or endpoints in all (N fixed)
        x = [p[0] if unit == "Service" else p[0] * p[1] for p in points]
        parts = []
        for layer in ("store", "model", "backend"):
            s = slope([(xi, results[p]["layers"][layer]) for xi, p in zip(x, points, strict=True)])
            parts.append(f"{layer} {s:,.0f} B")
        rss = slope([(xi, results[p]["synced_kb"] * 1000) for xi, p in zip(x, points, strict=True)])
        print(f"Slope {label}: RSS {rss:,.0f} B ({', '.join(parts)})")


if __name__ == "__main__":
    main()
