"""Which watch design for namespace opt-out? Objects and bytes the agent's client receives.

Against a fresh local control plane with 200 namespaces (100 labelled
networking.k8s.io/kube-proxy=disabled), each holding 10 Services with one EndpointSlice of 10
endpoints, three designs list+watch Services and EndpointSlices with the agent's own client
(kpx_kube.Client, which counts bytes and objects per resource) and reflector
(kpx_kube.reflector.Reflector) into a counting sink:

  (a) cluster-wide  one list+watch per resource, no field selector (filter in the agent)
  (b) exclusion     one list+watch per resource with metadata.namespace!=<each opted-out>
                    (the agent's design, see agents/kpx_agent/optout.py)
  (c) per-namespace one list+watch per resource in each of the 100 opted-in namespaces

For each: the initial list, a churn phase (every EndpointSlice in all 200 namespaces updated
once), and an opt-out toggle (one namespace opts out, then back in: what each design must
fetch again). Also the HTTP requests, TCP connections and concurrent watches each design needs.

Usage: python3 bench/optout_watch.py [--namespaces 200] [--services-per-namespace 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from benchlib import (
    OPT_OUT_LABEL,
    OPT_OUT_VALUE,
    ApiClient,
    bench_cluster,
    component_pid,
    endpoint_slice,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    namespace,
    proc_cpu_seconds,
    service,
    services_path,
    slices_path,
    update_latest,
    write_json,
)
from kpx_agent.optout import exclusion_field_selector
from kpx_agent.resources import SERVICES_RESOURCE, SLICES_RESOURCE
from kpx_cluster.controlplane import Cluster
from kpx_kube import Client, Credentials, from_kubeconfig
from kpx_kube.reflector import Reflector, Resource

ENDPOINTS_PER_SLICE = 10
AGENT_CONNECTION_LIMIT = 16  # kpx_kube.Client's default `connections`
SYNC_TIMEOUT = 300.0
CHURN_TIMEOUT = 300.0
QUIET_SECONDS = 1.5
DESIGNS = ("cluster-wide", "exclusion", "per-namespace")


# ---- the workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    namespaces: list[str]
    opted_out: list[str]
    services_per_namespace: int

    @property
    def opted_in(self) -> list[str]:
        out = set(self.opted_out)
        return [ns for ns in self.namespaces if ns not in out]

    def slice_names(self) -> list[str]:
        return [f"svc-{i:03d}-1" for i in range(self.services_per_namespace)]


def _addresses(ns_index: int, svc: int, generation: int) -> list[tuple[str, str]]:
    base = (ns_index * 100 + svc) % 250 + 1
    return [
        (f"10.244.{(j * 20 + generation) % 250}.{base}", f"node-{j % 4}")
        for j in range(ENDPOINTS_PER_SLICE)
    ]


def create_workload(api: ApiClient, count: int, per_ns: int) -> tuple[Workload, float]:
    names = [f"optout-{i:03d}" for i in range(count)]
    opted_out = names[1::2]
    started = time.monotonic()
    api.many(
        "POST",
        [
            (
                "/api/v1/namespaces",
                namespace(ns, {OPT_OUT_LABEL: OPT_OUT_VALUE} if ns in opted_out else {}),
            )
            for ns in names
        ],
    )
    svcs = [(ns, i, f"svc-{i:03d}") for ns in names for i in range(per_ns)]
    api.many("POST", [(services_path(ns), service(ns, name)) for ns, _, name in svcs])
    api.many(
        "POST",
        [
            (slices_path(ns), endpoint_slice(ns, name, _addresses(k // per_ns, i, 0)))
            for k, (ns, i, name) in enumerate(svcs)
        ],
    )
    return Workload(names, opted_out, per_ns), time.monotonic() - started


def churn(api: ApiClient, work: Workload, generation: int) -> float:
    """Update every EndpointSlice once (one endpoint address changes); seconds it took."""
    started = time.monotonic()
    patches = []
    for k, ns in enumerate(work.namespaces):
        for i, name in enumerate(work.slice_names()):
            eps = endpoint_slice(ns, name, _addresses(k, i, generation))["endpoints"]
            patches.append((slices_path(ns, name), {"endpoints": eps}))
    api.many("PATCH", patches)
    return time.monotonic() - started


# ---- the client side ---------------------------------------------------------------------------


class CountingClient(Client):
    """The agent's client (kpx_kube), which also counts HTTP requests and TCP connections."""

    def __init__(self, creds: Credentials, limit: int = AGENT_CONNECTION_LIMIT) -> None:
        super().__init__(creds, connections=limit)

    def totals(self) -> tuple[int, int]:
        """(objects, bytes) received so far, all resources."""
        return sum(self.objects_received.values()), sum(self.bytes_received.values())


class CountingSink:
    """A reflector sink that only counts what it is given, and wakes waiters on each event."""

    def __init__(self) -> None:
        self.listed: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.changed = asyncio.Event()

    def replace(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        self.listed[kind] += sum(1 for _ in objs)
        self.changed.set()

    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.events[kind] += 1
        self.changed.set()

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.events[kind] += 1
        self.changed.set()

    async def wait_for(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the expected events did not arrive")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 1.0))


def namespaced(resource: Resource, ns: str) -> Resource:
    """The same resource, listed and watched in one namespace only."""
    prefix, plural = resource.path.rsplit("/", 1)
    return Resource(resource.kind, f"{prefix}/namespaces/{ns}/{plural}", resource.label_selector)


@dataclass
class Phase:
    objects: int = 0
    bytes: int = 0
    seconds: float = 0.0
    apiserver_cpu_s: float = 0.0


@dataclass
class DesignResult:
    design: str
    watches: int = 0
    requests: int = 0
    connections: int = 0
    selector_chars: int = 0
    listed: Phase = field(default_factory=Phase)
    churn: Phase = field(default_factory=Phase)
    churn_expected_events: int = 0
    toggle: Phase = field(default_factory=Phase)
    toggle_requests: int = 0
    client_cpu_list_s: float = 0.0


class Design:
    """One way of watching Services and EndpointSlices, running its reflectors."""

    def __init__(self, name: str, creds: Credentials, work: Workload) -> None:
        self.name = name
        self.work = work
        limit = 0 if name == "per-namespace" else AGENT_CONNECTION_LIMIT
        self.client = CountingClient(creds, limit)
        self.sink = CountingSink()
        self.excluded: set[str] = set(work.opted_out)
        self.reflectors: dict[str, list[Reflector]] = {}
        self.tasks: dict[str, list[asyncio.Task[None]]] = {}

    def selector(self) -> str:
        return exclusion_field_selector(self.excluded) if self.name == "exclusion" else ""

    def start_group(self, key: str, resources: list[Resource]) -> list[Reflector]:
        refl = [
            Reflector(self.client, r, self.sink, field_selector=self.selector) for r in resources
        ]
        self.reflectors[key] = refl
        self.tasks[key] = [asyncio.create_task(r.run()) for r in refl]
        return refl

    def start(self) -> list[Reflector]:
        base = [SERVICES_RESOURCE, SLICES_RESOURCE]
        if self.name != "per-namespace":
            return self.start_group("*", base)
        started: list[Reflector] = []
        for ns in self.work.opted_in:
            started += self.start_group(ns, [namespaced(r, ns) for r in base])
        return started

    async def stop_group(self, key: str) -> None:
        tasks = self.tasks.pop(key, [])
        self.reflectors.pop(key, None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for key in list(self.tasks):
            await self.stop_group(key)
        await self.client.close()

    def watches(self) -> int:
        return sum(len(r) for r in self.reflectors.values())

    def expected_churn_events(self) -> int:
        namespaces = self.work.namespaces if self.name == "cluster-wide" else self.work.opted_in
        return len(namespaces) * self.work.services_per_namespace


async def wait_synced(reflectors: list[Reflector], lists: int = 1) -> None:
    async def one(r: Reflector) -> None:
        while r.lists < lists:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(asyncio.gather(*(one(r) for r in reflectors)), SYNC_TIMEOUT)


class CpuMeter:
    """CPU seconds of the apiserver and of this process over one phase."""

    def __init__(self, apiserver_pid: int | None) -> None:
        self.pid = apiserver_pid

    def apiserver(self) -> float:
        return proc_cpu_seconds(self.pid)[0] if self.pid else 0.0


# ---- the phases --------------------------------------------------------------------------------


async def measure_list(design: Design, result: DesignResult, cpu: CpuMeter) -> None:
    api0, own0, t0 = cpu.apiserver(), time.process_time(), time.monotonic()
    await wait_synced(design.start())
    result.listed.seconds = time.monotonic() - t0
    result.client_cpu_list_s = time.process_time() - own0
    result.listed.apiserver_cpu_s = cpu.apiserver() - api0
    result.listed.objects, result.listed.bytes = design.client.totals()
    result.watches = design.watches()
    result.selector_chars = len(design.selector())
    await asyncio.sleep(QUIET_SECONDS)  # let every watch open before the churn starts


async def measure_churn(
    design: Design, result: DesignResult, api: ApiClient, cpu: CpuMeter, generation: int
) -> None:
    objects0, bytes0 = design.client.totals()
    events0 = design.sink.events["endpointslices"]
    expected = design.expected_churn_events()
    result.churn_expected_events = expected
    api0, t0 = cpu.apiserver(), time.monotonic()
    write_seconds = await asyncio.to_thread(churn, api, design.work, generation)
    await design.sink.wait_for(
        lambda: design.sink.events["endpointslices"] - events0 >= expected, CHURN_TIMEOUT
    )
    result.churn.seconds = time.monotonic() - t0
    await asyncio.sleep(QUIET_SECONDS)  # anything beyond the expected events is counted too
    result.churn.apiserver_cpu_s = cpu.apiserver() - api0
    objects1, bytes1 = design.client.totals()
    result.churn.objects, result.churn.bytes = objects1 - objects0, bytes1 - bytes0
    log(
        f"  churn: {expected} expected events; writes took {write_seconds:.1f}s, "
        f"delivered after {result.churn.seconds:.1f}s"
    )


async def measure_toggle(design: Design, result: DesignResult, cpu: CpuMeter) -> None:
    """One opted-in namespace opts out, then back in: what must the design fetch again?"""
    ns = design.work.opted_in[0]
    objects0, bytes0 = design.client.totals()
    api0, t0 = cpu.apiserver(), time.monotonic()
    if design.name == "exclusion":
        for change in (design.excluded.add, design.excluded.discard):
            change(ns)
            refl = design.reflectors["*"]
            lists = [r.lists for r in refl]
            for r in refl:
                r.restart()
            await asyncio.gather(
                *(wait_synced([r], n + 1) for r, n in zip(refl, lists, strict=True))
            )
    elif design.name == "per-namespace":
        await design.stop_group(ns)
        base = [SERVICES_RESOURCE, SLICES_RESOURCE]
        await wait_synced(design.start_group(ns, [namespaced(r, ns) for r in base]))
    # cluster-wide: the agent already has every namespace's objects; nothing to fetch.
    result.toggle.seconds = time.monotonic() - t0
    result.toggle.apiserver_cpu_s = cpu.apiserver() - api0
    objects1, bytes1 = design.client.totals()
    result.toggle.objects, result.toggle.bytes = objects1 - objects0, bytes1 - bytes0


async def run_design(
    name: str, creds: Credentials, work: Workload, api: ApiClient, cpu: CpuMeter, generation: int
) -> DesignResult:
    log(f"design {name}")
    design = Design(name, creds, work)
    result = DesignResult(name)
    try:
        await measure_list(design, result, cpu)
        log(f"  list: {result.listed.objects} objects, {result.listed.bytes / 1e6:.2f} MB")
        await measure_churn(design, result, api, cpu, generation)
        result.requests, result.connections = (
            design.client.requests_sent,
            design.client.connections_opened,
        )
        await measure_toggle(design, result, cpu)
        result.toggle_requests = design.client.requests_sent - result.requests
    finally:
        await design.close()
    return result


# ---- reporting ---------------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def report(results: list[DesignResult], work: Workload, info: Mapping[str, str]) -> str:
    total = len(work.namespaces) * work.services_per_namespace
    rows = [
        (
            f"({'abc'[i]}) {r.design}",
            r.watches,
            r.requests,
            r.connections,
            f"{r.listed.objects:,}",
            _mb(r.listed.bytes),
            f"{r.listed.seconds:.2f}",
            f"{r.client_cpu_list_s:.2f}",
            f"{r.churn.objects:,}",
            _mb(r.churn.bytes),
            r.toggle_requests,
            f"{r.toggle.objects:,}",
            _mb(r.toggle.bytes),
            f"{r.listed.apiserver_cpu_s:.2f} / {r.churn.apiserver_cpu_s:.2f}",
        )
        for i, r in enumerate(results)
    ]
    headers = (
        "design",
        "watches",
        "HTTP requests",
        "TCP conns",
        "list objects",
        "list MB",
        "list s",
        "client CPU s (list)",
        "churn events",
        "churn MB",
        "toggle requests",
        "toggle objects",
        "toggle MB",
        "apiserver CPU s list / churn",
    )
    return (
        f"## Opt-out watch designs ({len(work.namespaces)} namespaces, "
        f"{len(work.opted_out)} opted out, {total:,} Services + {total:,} EndpointSlices "
        f"of {ENDPOINTS_PER_SLICE} endpoints)\n\n"
        f"Machine: {machine_line(info)}.\n\n"
        + markdown_table(headers, rows)
        + "\nWatches, HTTP requests and TCP connections: steady state (initial list, watch, "
        "churn). Bytes are response bodies received by KubeClient (lists and watch streams). "
        "Churn: every EndpointSlice of all namespaces updated once. Toggle: one opted-in "
        "namespace opts out and back in (what must be fetched again). The exclusion "
        f"selector is {results[1].selector_chars:,} characters long. "
        "(c) needs an unlimited connection pool: the agent's KubeClient allows 16 "
        "connections, and every HTTP/1.1 watch holds one.\n"
    )


async def run_all(cluster: Cluster, work: Workload, api: ApiClient) -> list[DesignResult]:
    creds = from_kubeconfig(cluster.kubeconfig)
    cpu = CpuMeter(component_pid(cluster, "kube-apiserver"))
    results = []
    for generation, name in enumerate(DESIGNS, start=1):
        results.append(await run_design(name, creds, work, api, cpu, generation))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespaces", type=int, default=200)
    parser.add_argument("--services-per-namespace", type=int, default=10)
    args = parser.parse_args()
    exit_on_sigterm()
    info = machine_info()
    started = time.monotonic()
    with bench_cluster("bench") as cluster:
        api = ApiClient(cluster)
        try:
            work, created = create_workload(api, args.namespaces, args.services_per_namespace)
            log(f"created {len(work.namespaces)} namespaces and their objects in {created:.1f}s")
            results = asyncio.run(run_all(cluster, work, api))
        finally:
            api.close()
    markdown = report(results, work, info)
    print("\n" + markdown)
    data = {
        "benchmark": "optout_watch",
        "machine": info,
        "namespaces": len(work.namespaces),
        "opted_out": len(work.opted_out),
        "services_per_namespace": work.services_per_namespace,
        "endpoints_per_slice": ENDPOINTS_PER_SLICE,
        "creation_seconds": round(created, 2),
        "run_seconds": round(time.monotonic() - started, 1),
        "designs": [asdict(r) for r in results],
    }
    log(f"wrote {write_json('optout_watch.json', data)}")
    log(f"updated {update_latest('optout_watch', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
