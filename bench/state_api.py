"""The node-local state API at scale: what an out-of-tree backend pays over the in-process ones.

For N Service ports (default 10,000) of 10 endpoints each, two parts.

In process (the API alone): the agent's own model (model.types, as model.service_ports computes it),
served by the agent's real publisher and gRPC server on a unix socket, to clients in separate
processes built on kpx_localstate_client:

1. full state: its encoded size, the time to publish it (convert + encode, the sync's extra
   cost) and the time from publishing to a client's handler holding all N ports;
2. one change at a time (one endpoint address of one Service port, `--changes` times): the time
   from the end of the sync (publish) to the client's handler, as a delta (median and p95);
3. the server process's extra memory (RSS) with 1 and with 10 connected clients.

From the apiserver (the issue's definition; skipped with --no-apiserver): bench/workload.py's
N Services and EndpointSlices in a fresh local control plane (bench/benchlib.py), the real
agent (`proxy-agent`, a process in a fresh node network namespace, started as bench/compare.py
starts it), and a client process (kpx_localstate_client.run) on the socket:

4. `--mode nftables --state-socket`: one EndpointSlice write at a time (`--e2e-changes`, spaced
   beyond minSyncPeriod as bench/compare.py's changes) timed from the write to the kernel's
   endpoints map holding the new endpoint (bench/compare.py's own measurement, the netlink
   lookup of bench/kernel_probe.py: the in-process nftables backend, the anchor) and, for the
   same write, to the client's handler seeing it (the agent publishes after programming the
   kernel);
5. `--mode external` (the state-server-only agent an out-of-tree backend runs beside): the
   same writes timed to the client's handler (goal: under 50 ms median, as the in-process
   nftables backend); a new client's full state (connect to handler); the agent's RSS with 0,
   1 and 10 clients connected.

Usage: python3 bench/state_api.py [--services N] [--changes 50] [--e2e-changes 100]
Writes bench/results/state_api-<N>.json and bench/results/state_api.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for sub in ("agents", "kube", "api", "harness"):
    sys.path.insert(0, str(REPO / sub))

# The from-the-apiserver part runs the agent as bench/compare.py runs it and reads the kernel
# as it does.
from benchlib import (  # noqa: E402
    ApiClient,
    bench_cluster,
    log,
    machine_info,
    machine_line,
    median,
    percentile,
    proc_memory_kb,
)
from compare import (  # noqa: E402
    SETTLE_SECONDS,
    WORKERS,
    Dataplane,
    Probe,
    Running,
    node_netns,
    replace_endpoint,
    start,
    time_to_kernel,
    wait_cold_start,
)
from kpx_agent.model.types import IP, DataplaneSettings, Endpoint  # noqa: E402
from kpx_agent.state_api.address import Listen  # noqa: E402
from kpx_agent.state_api.publisher import Publisher  # noqa: E402
from kpx_agent.state_api.server import StateServer  # noqa: E402
from kpx_cluster.controlplane import Cluster  # noqa: E402
from report import KPX  # noqa: E402
from workload import NAMESPACE, Workload, create_node, grow, node_local_state, svc_name  # noqa: E402

RESULTS = REPO / "bench" / "results"
E2E_GAP_S = 1.2  # between two writes: beyond the agent's default minSyncPeriod (1 s)
COLD_TIMEOUT_S = 900.0

# A client process: prints one line per state received: revision, wall time, port count.
CLIENT = """
import sys, time
from kpx_localstate_client import StateClient, run
def handler(state):
    print(state.revision, repr(time.time()), len(state.service_ports), flush=True)
run(handler, sys.argv[1], client=StateClient(sys.argv[1]))
"""


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Clients:
    def __init__(self, target: str) -> None:
        self.target = target
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: list[list[tuple[int, float, int]]] = []

    def start(self) -> int:
        env = {**os.environ, "PYTHONPATH": str(REPO / "agents")}
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, self.target], stdout=subprocess.PIPE, text=True, env=env
        )
        index = len(self.procs)
        self.procs.append(proc)
        self.lines.append([])
        threading.Thread(target=self._read, args=(index,), daemon=True).start()
        return index

    def _read(self, index: int) -> None:
        out = self.procs[index].stdout
        assert out is not None
        for line in out:
            rev, t, count = line.split()
            self.lines[index].append((int(rev), float(t), int(count)))

    def wait_revision(self, index: int, revision: int, timeout: float = 60.0) -> tuple[float, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rev, t, count in self.lines[index]:
                if rev >= revision:
                    return t, count
            time.sleep(0.0005)
        raise TimeoutError(f"client {index} never got revision {revision}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=10)


def measure(n: int, changes: int) -> dict[str, Any]:
    state = node_local_state(n)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pub = Publisher()
    tmp = Path(tempfile.mkdtemp(prefix="kpx-state-bench-"))
    server = StateServer(pub, Listen(path=tmp / "run" / "state.sock"))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result()
    rss_base = rss_kib()

    t0 = time.perf_counter()
    pub.publish(state, DataplaneSettings(), None)
    publish_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    full_size = len(pub.answer("", 0, False))
    encode_full = time.perf_counter() - t0
    rss_published = rss_kib()

    clients = Clients(server.listen.target)
    sent = time.time()
    server.notify()
    first = clients.start()
    got, count = clients.wait_revision(first, 1)
    assert count == n, count
    delivery_full = got - sent  # includes the client process's start-up (python + grpc import)
    time.sleep(0.5)
    rss_one = rss_kib()

    keys = list(state.services)
    latencies, publish_costs = [], []
    for k in range(changes):
        key = keys[(k * 7919) % n]
        port = state.services[key]
        moved = (Endpoint(IP.of(f"10.250.{k // 250}.{k % 250 + 1}"), 8080),)
        state.services[key] = replace(port, cluster_endpoints=moved + port.cluster_endpoints[1:])
        t0 = time.perf_counter()
        pub.publish(state, DataplaneSettings(), {key})
        publish_costs.append(time.perf_counter() - t0)
        sent = time.time()
        server.notify()
        got, _ = clients.wait_revision(first, pub.revision)
        latencies.append(got - sent)
        time.sleep(0.02)

    for _ in range(9):
        index = clients.start()
        clients.wait_revision(index, pub.revision)
    time.sleep(0.5)
    rss_ten = rss_kib()
    clients.stop()
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    latencies.sort()
    return {
        "services": n,
        "endpoints_per_service": 10,
        "full_state_bytes": full_size,
        "publish_full_s": round(publish_full, 4),
        "encode_full_response_s": round(encode_full, 4),
        "full_delivery_s_incl_client_start": round(delivery_full, 3),
        "change_to_handler_ms_median": round(statistics.median(latencies) * 1000, 2),
        "change_to_handler_ms_p95": round(latencies[int(len(latencies) * 0.95) - 1] * 1000, 2),
        "publish_one_change_ms_median": round(statistics.median(publish_costs) * 1000, 3),
        "changes": changes,
        "server_rss_state_kib": rss_published - rss_base,
        "server_rss_extra_1_client_kib": rss_one - rss_published,
        "server_rss_extra_10_clients_kib": rss_ten - rss_published,
    }


# ---- from the apiserver: the real agent, the real watch ------------------------------------------

# A client process reporting when the Service ports it is told to watch change. Reads
# "NAMESPACE NAME" lines on stdin (answers "watching NAME"); prints "start T" once, "full REV T
# COUNT" for each full state, and "seen NAME REV T IP:PORT,IP:PORT,..." when a watched port's
# cluster endpoints differ from the last printed. T: time.monotonic(), one clock for the
# machine.
WATCH_CLIENT = """
import sys, threading, time
from kpx_localstate_client import PortKey, StateClient, localstate_pb2 as pb, run
print("start", repr(time.monotonic()), flush=True)
watched, lock = {}, threading.Lock()
def read():
    for line in sys.stdin:
        ns, name = line.split()
        with lock:
            watched[PortKey(ns, name, "http", pb.TCP, 4)] = None
        print("watching", name, flush=True)
threading.Thread(target=read, daemon=True).start()
def handler(state):
    now = time.monotonic()
    if state.changed is None:
        print("full", state.revision, repr(now), len(state.service_ports), flush=True)
    with lock:
        keys = list(watched) if state.changed is None else set(state.changed) & set(watched)
        for key in keys:
            port = state.service_ports.get(key)
            eps = ",".join(f"{e.ip}:{e.port}" for e in port.cluster_endpoints) if port else "-"
            if watched[key] != eps:
                watched[key] = eps
                print("seen", key.name, state.revision, repr(now), eps, flush=True)
run(handler, sys.argv[1], client=StateClient(sys.argv[1]))
"""


class WatchClient:
    """One WATCH_CLIENT process on the host (the socket is a file: no netns needed)."""

    def __init__(self, target: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO / "agents")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCH_CLIENT, target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[list[str]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.split())
                self._cond.notify_all()

    def wait(self, match: Any, timeout: float = 120.0) -> list[str]:
        """The first line (split) for which match(words) is true."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for words in self.lines:
                    if match(words):
                        return words
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"client: no such line in {self.lines[-5:]}")
                self._cond.wait(left)

    def full_state(self, count: int) -> tuple[float, float]:
        """(the process's start after its imports, its handler holding at least `count`
        ports: the workload's, and the cluster's own `kubernetes` Service)."""
        start = float(self.wait(lambda w: w[0] == "start")[1])
        full = self.wait(lambda w: w[0] == "full" and int(w[3]) >= count)
        return start, float(full[2])

    def watch(self, namespace: str, name: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{namespace} {name}\n")
        self.proc.stdin.flush()
        self.wait(lambda w: w == ["watching", name])

    def seen(self, name: str, new: str, old: str) -> float:
        """When the handler saw `name`'s endpoints with `new` and without `old` ('IP:PORT')."""

        def match(w: list[str]) -> bool:
            if w[0] != "seen" or w[1] != name:
                return False
            eps = w[4].split(",")
            return new in eps and old not in eps

        return float(self.wait(match, timeout=60.0)[3])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _agent_rss_kib(pid: int) -> int:
    return int(proc_memory_kb(pid).get("VmRSS", 0))


def _wait_first_sync(run: Running, timeout: float = 300.0) -> float:
    """Seconds from the agent's start to its first full sync (its log; after the initial
    lists, so of every Service)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run.check_alive()
        if (t := run.log_time(": full sync, ")) is not None:
            return t
        time.sleep(0.05)
    raise TimeoutError(f"no full sync; agent log:\n{run.log_tail()}")


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "median": round(median(values), 2),
        "p90": round(percentile(values, 90), 2),
        "p99": round(percentile(values, 99), 2),
        "max": round(max(values), 2),
    }


def _with_nftables(
    cluster: Cluster, api: ApiClient, work: Workload, services: list[int]
) -> dict[str, Any]:
    """Mode nftables with the state API, in a fresh node netns: each write timed to the kernel
    (bench/compare.py's time_to_kernel, the anchor) and to the client's handler."""
    dp = Dataplane(KPX, "nftables")
    with node_netns(cluster) as (topo, node):
        socket_path = topo.tmpdir / "state" / "state.sock"
        probe = Probe(topo, node)
        run = start(
            dp, topo, node, cluster, "kpx-nftables-state", ["--state-socket", str(socket_path)]
        )
        client = None
        try:
            cold, chains = wait_cold_start(dp, probe, run, topo, node, work, COLD_TIMEOUT_S)
            if cold.timed_out:
                raise TimeoutError(f"{dp.label}: not all Services in the kernel")
            log(f"{dp.label} + state API: cold start {cold.seconds:.2f} s")
            client = WatchClient(f"unix://{socket_path}")
            client.full_state(work.size)
            time.sleep(SETTLE_SECONDS)
            kernel: list[float] = []
            handler: list[float] = []
            poll_s, polls = 0.0, 0
            for svc in services:
                run.check_alive()
                client.watch(NAMESPACE, svc_name(svc))
                write = replace_endpoint(api, work, svc)
                change, spent = time_to_kernel(dp, probe, work, chains, write)
                seen = client.seen(svc_name(svc), write.new, write.old)
                kernel.append(change.latency_ms)
                handler.append((seen - write.sent) * 1000)
                poll_s, polls = poll_s + spent, polls + change.polls
                time.sleep(max(0.0, E2E_GAP_S - (time.monotonic() - write.sent)))
            log(
                f"nftables + state API: kernel {median(kernel):.1f} ms, handler "
                f"{median(handler):.1f} ms median"
            )
            return {
                "cold_start_kernel_s": round(cold.seconds, 2),
                "write_to_kernel_ms": _ms(kernel),
                "write_to_handler_ms": _ms(handler),
                "kernel_poll_ms": round(poll_s / max(1, polls) * 1000, 2),
                "samples": [
                    [round(a, 2), round(b, 2)] for a, b in zip(kernel, handler, strict=True)
                ],
            }
        except Exception:
            log(f"agent log tail:\n{run.log_tail()}")
            raise
        finally:
            probe.close()
            if client is not None:
                client.stop()
            run.stop()


def _external(
    cluster: Cluster, api: ApiClient, work: Workload, services: list[int]
) -> dict[str, Any]:
    """Mode external (no kernel rules), in a fresh node netns: writes timed to the handler;
    memory with 0, 1 and 10 clients; full states to new clients."""
    dp = Dataplane(KPX, "external")
    with node_netns(cluster) as (topo, node):
        socket_path = topo.tmpdir / "state" / "state.sock"
        config = topo.tmpdir / "external.yaml"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "proxy.kpx.dev/v1alpha1",
                    "kind": "AgentConfiguration",
                    "mode": "external",
                    "external": {"image": "example.com/bench-plugin:1"},
                }
            )
        )
        extra = ["--config", str(config), "--state-socket", str(socket_path)]
        run = start(dp, topo, node, cluster, "kpx-external", extra)
        clients: list[WatchClient] = []
        try:
            synced_s = _wait_first_sync(run)
            time.sleep(SETTLE_SECONDS)
            rss_none = _agent_rss_kib(run.pid)
            first = WatchClient(f"unix://{socket_path}")
            clients.append(first)
            start_t, full = first.full_state(work.size)
            time.sleep(SETTLE_SECONDS)
            rss_one = _agent_rss_kib(run.pid)
            handler = []
            for svc in services:
                run.check_alive()
                first.watch(NAMESPACE, svc_name(svc))
                write = replace_endpoint(api, work, svc)
                handler.append(
                    (first.seen(svc_name(svc), write.new, write.old) - write.sent) * 1000
                )
                time.sleep(max(0.0, E2E_GAP_S - (time.monotonic() - write.sent)))
            log(f"external: handler {median(handler):.1f} ms median")
            deliveries = []
            for _ in range(9):
                client = WatchClient(f"unix://{socket_path}")
                clients.append(client)
                c_start, c_full = client.full_state(work.size)
                deliveries.append(c_full - c_start)
            time.sleep(SETTLE_SECONDS)
            rss_ten = _agent_rss_kib(run.pid)
            return {
                "first_full_sync_s": round(synced_s, 2),
                "write_to_handler_ms": _ms(handler),
                "samples": [round(h, 2) for h in handler],
                "full_state_first_client_s": round(full - start_t, 3),
                "full_state_new_client_s_median": round(median(deliveries), 3),
                "agent_rss_kib_no_client": rss_none,
                "agent_rss_extra_1_client_kib": rss_one - rss_none,
                "agent_rss_extra_10_clients_kib": rss_ten - rss_none,
            }
        except Exception:
            log(f"agent log tail:\n{run.log_tail()}")
            raise
        finally:
            for client in clients:
                client.stop()
            run.stop()


def measure_from_apiserver(n: int, changes: int) -> dict[str, Any]:
    started, load = time.monotonic(), os.getloadavg()
    work = Workload()
    with bench_cluster("state-api") as cluster:
        api = ApiClient(cluster, WORKERS)
        try:
            create_node(api, work)
            grow(cluster, api, work, n)
            made = work.creation[-1]
            log(f"created in {made['services_s'] + made['slices_s']:.1f}s")
            work.settle_node()
            picks = random.Random(n).sample(range(n), min(2 * changes, n))
            nft = _with_nftables(cluster, api, work, picks[:changes])
            ext = _external(cluster, api, work, picks[changes:])
        finally:
            api.close()
    return {
        "services": n,
        "changes": changes,
        "gap_s": E2E_GAP_S,
        "load_average_at_start": [round(x, 2) for x in load],
        "nftables_with_state_api": nft,
        "external": ext,
        "run_s": round(time.monotonic() - started, 1),
    }


def report(r: dict[str, Any], e2e: dict[str, Any] | None) -> str:
    lines = [
        f"## Node-local state API, {r['services']:,} Service ports x 10 endpoints",
        "",
        f"Machine: {machine_line(machine_info())}",
        "",
    ]
    if e2e is not None:
        nft, ext = e2e["nftables_with_state_api"], e2e["external"]
        goal = "met" if ext["write_to_handler_ms"]["median"] < 50 else "NOT met"

        def row(name: str, ms: dict[str, float]) -> str:
            return f"| {name} | {ms['median']} | {ms['p90']} | {ms['p99']} | {ms['max']} |"

        lines += [
            "### From an EndpointSlice write at the apiserver (the issue's latency)",
            "",
            f"{e2e['changes']} writes per mode, one every {e2e['gap_s']} s (beyond "
            "minSyncPeriod), each replacing one endpoint address of one Service's slice "
            "(bench/workload.py's workload in a fresh local control plane); the agent a "
            "process in a node netns; the client a `kpx_localstate_client.run` process. "
            f"Load average at start: {e2e['load_average_at_start']}. The kernel is read as "
            f"bench/compare.py reads it: one netlink lookup of the VIP's buckets took "
            f"{nft['kernel_poll_ms']} ms on average, the next followed after at least twice that.",
            "",
            "| from the write to ... (ms) | median | p90 | p99 | max |",
            "| --- | --- | --- | --- | --- |",
            row(
                "mode nftables: the kernel's endpoints map (the anchor)", nft["write_to_kernel_ms"]
            ),
            row(
                "mode nftables + state API: the client's handler (published after the kernel)",
                nft["write_to_handler_ms"],
            ),
            row(
                f"mode external: the client's handler (goal < 50 ms median: {goal})",
                ext["write_to_handler_ms"],
            ),
            "",
            "| mode external | value |",
            "| --- | --- |",
            f"| agent start -> first full sync of the {r['services']:,} ports | "
            f"{ext['first_full_sync_s']} s |",
            f"| full state to the first client's handler (connect, receive, decode) | "
            f"{ext['full_state_first_client_s']} s |",
            f"| full state to each of 9 more clients (median) | "
            f"{ext['full_state_new_client_s_median']} s |",
            f"| agent RSS, no client | {ext['agent_rss_kib_no_client'] / 1024:.0f} MiB |",
            f"| agent RSS, extra with 1 client | +{ext['agent_rss_extra_1_client_kib']} KiB |",
            f"| agent RSS, extra with 10 clients | +{ext['agent_rss_extra_10_clients_kib']} KiB |",
            "",
        ]
    lines += [
        "### The API alone (publisher and gRPC server in the bench process)",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| full state, encoded | {int(r['full_state_bytes']) / 1e6:.1f} MB |",
        f"| publish the full state (convert + encode per port) | {r['publish_full_s']} s |",
        f"| assemble the full response (once per revision) | {r['encode_full_response_s']} s |",
        f"| full state to a new client's handler (incl. its start) | "
        f"{r['full_delivery_s_incl_client_start']} s |",
        f"| one change: publish (in the sync) | {r['publish_one_change_ms_median']} ms median |",
        f"| one change: end of sync -> client handler | {r['change_to_handler_ms_median']} ms "
        f"median, {r['change_to_handler_ms_p95']} ms p95 |",
        f"| server memory: the published state | {r['server_rss_state_kib']} KiB |",
        f"| server memory: 1 client | +{r['server_rss_extra_1_client_kib']} KiB |",
        f"| server memory: 10 clients | +{r['server_rss_extra_10_clients_kib']} KiB |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=50, help="in process")
    parser.add_argument(
        "--e2e-changes", type=int, default=100, help="EndpointSlice writes per agent mode"
    )
    parser.add_argument(
        "--no-apiserver", action="store_true", help="only the in-process part (no root needed)"
    )
    args = parser.parse_args()
    result = measure(args.services, args.changes)
    e2e = None if args.no_apiserver else measure_from_apiserver(args.services, args.e2e_changes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {**result, "from_apiserver": e2e}
    (RESULTS / f"state_api-{args.services}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = report(result, e2e)
    (RESULTS / "state_api.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
