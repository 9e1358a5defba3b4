"""Where the agent's time goes at N Services: its pipeline in-process, phase by phase.

No control plane and no agent process: the same Services and EndpointSlices as
bench/workload.py (shaped like the apiserver's list items, managedFields included) go
through the agent's own code, timed phase by phase:

  decode    the list pages decoded as kpx_kube.Client.list does (orjson),
            each item slimmed as the Reflector does (kpx_kube.reflector.slim)
  ingest    ClusterState.replace (what the reflectors do after their lists)
  first     Proxier.sync: the first (full) sync; the `nft -f` part timed on its own
  resync    touch_all + Proxier.sync: what every syncPeriod (30 s) costs
  change    one EndpointSlice changes + Proxier.sync

With --nft, scripts go to a real `nft -f -` in a scratch network namespace (removed at the
end); without it they are only rendered. --profile PHASE prints a cProfile of that phase;
--save-scripts DIR keeps each sync's script (sync-1.nft is the full one) for experiments;
--gc off|threshold shows what the cyclic garbage collector costs.

Usage: python3 bench/profile_sync.py [--services 10000] [--nft] [--profile first]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import ipaddress
import json
import os
import pstats
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchlib import endpoint_slice, proc_memory_kb, service
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.cluster_state import ClusterState
from kpx_agent.localnet import ProxySettings
from kpx_agent.metrics import AgentMetrics
from kpx_agent.proxier import Proxier
from kpx_api.proxysettings import NamespaceOptOut
from kpx_kube.reflector import slim
from workload import (
    NAMESPACE,
    TARGET_PORT,
    endpoint_addresses,
    svc_name,
)

Obj = dict[str, Any]
PAGE = 1000


loads = orjson.loads  # as kpx_kube.Client.list decodes
PHASES = ("decode", "ingest", "first", "resync", "change")


def _managed(manager: str, api_version: str, fields: Obj) -> list[Obj]:
    return [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": api_version,
            "time": "2026-01-01T00:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
    ]


def _meta(obj: Obj, rv: int) -> None:
    obj["metadata"].update(
        uid=str(uuid.uuid4()),
        resourceVersion=str(rv),
        creationTimestamp="2026-01-01T00:00:00Z",
    )


def api_service(i: int) -> Obj:
    """A Service as the apiserver lists it (allocated ClusterIP, defaults, managedFields)."""
    obj = service(NAMESPACE, svc_name(i))
    vip = str(ipaddress.IPv4Address("10.96.0.10") + i)
    _meta(obj, 1000 + i)
    obj["metadata"]["managedFields"] = _managed(
        "kpx-bench",
        "v1",
        {
            "f:spec": {
                "f:internalTrafficPolicy": {},
                "f:ports": {
                    ".": {},
                    'k:{"port":80,"protocol":"TCP"}': {
                        ".": {},
                        "f:name": {},
                        "f:port": {},
                        "f:protocol": {},
                        "f:targetPort": {},
                    },
                },
                "f:sessionAffinity": {},
                "f:type": {},
            }
        },
    )
    obj["spec"].update(
        clusterIP=vip,
        clusterIPs=[vip],
        sessionAffinity="None",
        ipFamilies=["IPv4"],
        ipFamilyPolicy="SingleStack",
        internalTrafficPolicy="Cluster",
    )
    obj["status"] = {"loadBalancer": {}}
    return obj


def api_slice(i: int) -> Obj:
    obj = endpoint_slice(NAMESPACE, svc_name(i), endpoint_addresses(i), TARGET_PORT)
    _meta(obj, 100000 + i)
    obj["metadata"]["generation"] = 1
    obj["metadata"]["managedFields"] = _managed(
        "kpx-bench",
        "discovery.k8s.io/v1",
        {
            "f:addressType": {},
            "f:endpoints": {},
            "f:metadata": {"f:labels": {".": {}, "f:kubernetes.io/service-name": {}}},
            "f:ports": {},
        },
    )
    return obj


def list_pages(kind: str, items: list[Obj]) -> list[bytes]:
    return [
        json.dumps({"kind": kind, "metadata": {}, "items": items[i : i + PAGE]}).encode()
        for i in range(0, len(items), PAGE)
    ]


# ---- nft in a scratch netns --------------------------------------------------------------------


@dataclass
class NftRunner:
    """The backend's run_script: `nft -f -` in a scratch netns, or nothing; timed either way."""

    netns: str | None
    save_dir: Path | None = None
    seconds: list[float] = field(default_factory=list)
    script_bytes: list[int] = field(default_factory=list)

    def __call__(self, parts: Iterable[str]) -> None:
        # Rendered in full before nft starts (the agent streams the parts into nft instead),
        # so the render and the load are timed apart.
        script = "".join(parts)
        if self.save_dir is not None:
            (self.save_dir / f"sync-{len(self.seconds) + 1}.nft").write_text(script)
        t0 = time.perf_counter()
        if self.netns is not None:
            proc = subprocess.run(
                ["ip", "netns", "exec", self.netns, "nft", "-f", "-"],
                input=script,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"nft: {proc.stderr.strip()[:500]}")
        self.seconds.append(time.perf_counter() - t0)
        self.script_bytes.append(len(script))


@contextlib.contextmanager
def scratch_netns(enabled: bool) -> Iterator[str | None]:
    if not enabled:
        yield None
        return
    name = f"bench-prof-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


# ---- the phases --------------------------------------------------------------------------------


@dataclass
class Pipeline:
    n: int
    runner: NftRunner
    state: ClusterState = field(default_factory=ClusterState)
    pages: dict[str, list[bytes]] = field(default_factory=dict)
    decoded: dict[str, list[Obj]] = field(default_factory=dict)
    proxier: Proxier | None = None

    def decode(self) -> None:
        for kind, pages in self.pages.items():
            self.decoded[kind] = [slim(o) for page in pages for o in loads(page)["items"]]

    def ingest(self) -> None:
        for kind in ("services", "endpointslices"):
            self.state.replace(kind, self.decoded[kind])

    def first(self) -> None:
        settings = ProxySettings(cluster_cidrs=(ipaddress.ip_network("10.244.0.0/16"),))
        backend = NftablesBackend(settings, run_script=self.runner, present_families=lambda: {4, 6})
        self.proxier = Proxier(
            self.state, backend, "bench-node-0", NamespaceOptOut(), AgentMetrics()
        )
        self.proxier.delete_flows = lambda flows: 0
        self._sync()

    def resync(self) -> None:
        self.state.touch_all()
        self._sync()

    def change(self) -> None:
        obj = json.loads(json.dumps(self.decoded["endpointslices"][self.n // 2]))
        obj["endpoints"][-1]["addresses"] = ["10.244.200.1"]
        obj["metadata"]["resourceVersion"] = "999999999"
        self.state.upsert("endpointslices", obj)
        self._sync()

    def _sync(self) -> None:
        assert self.proxier is not None
        outcome = self.proxier.sync()
        if not outcome.ok:
            raise RuntimeError(outcome.error)


def timed(fn: Callable[[], None], profile: bool) -> float:
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.runcall(fn)
    else:
        fn()
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(18)
        stats.sort_stats("cumulative").print_stats(18)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--nft", action="store_true", help="apply scripts with nft (needs root)")
    parser.add_argument("--profile", choices=PHASES, action="append", default=[])
    parser.add_argument(
        "--gc",
        choices=("default", "off", "threshold"),
        default="default",
        help="what-if for the cyclic GC: as the agent (default), disabled, or gen0 threshold "
        "raised to 100,000 allocations",
    )
    parser.add_argument("--save-scripts", type=Path, help="write each sync's nft script here")
    args = parser.parse_args()
    n = args.services
    if args.gc == "off":
        gc.disable()
    elif args.gc == "threshold":
        gc.set_threshold(100_000, 50, 100)
    with scratch_netns(args.nft) as netns:
        if args.save_scripts is not None:
            args.save_scripts.mkdir(parents=True, exist_ok=True)
        runner = NftRunner(netns, args.save_scripts)
        pipe = Pipeline(n, runner)
        pipe.pages = {
            "services": list_pages("ServiceList", [api_service(i) for i in range(n)]),
            "endpointslices": list_pages("EndpointSliceList", [api_slice(i) for i in range(n)]),
        }
        size = sum(len(p) for pages in pipe.pages.values() for p in pages)
        print(f"{n} Services + {n} EndpointSlices: {size / 1e6:.1f} MB of list pages")
        rss0 = proc_memory_kb(os.getpid())["VmRSS"]
        for phase in PHASES:
            nft_before = len(runner.seconds)
            elapsed = timed(getattr(pipe, phase), phase in args.profile)
            nft_s = sum(runner.seconds[nft_before:])
            script = sum(runner.script_bytes[nft_before:])
            rss = proc_memory_kb(os.getpid())["VmRSS"]
            extra = f", of which nft -f {nft_s:.3f} s ({script / 1e6:.1f} MB)" if script else ""
            print(f"{phase:>7}: {elapsed:.3f} s{extra}; RSS +{(rss - rss0) / 1024:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
