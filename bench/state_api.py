"""The node-local state API at scale: what an out-of-tree backend pays over the in-process ones.

For N Service ports (default 10,000) of 10 endpoints each, in the agent's own model (localnet,
as node_local computes it), served by the agent's real publisher and gRPC server on a unix
socket, to clients in separate processes built on kpx_localstate_client:

1. full state: its encoded size, the time to publish it (convert + encode, the sync's extra
   cost) and the time from publishing to a client's handler holding all N ports;
2. one change at a time (one endpoint address of one Service port, `--changes` times): the time
   from the end of the sync (publish) to the client's handler, as a delta (median and p95;
   goal: under 50 ms median). The watch and the model before it are the agent's, the same for
   every backend (bench/compare.py measures them);
3. the server process's extra memory (RSS) with 1 and with 10 connected clients.

Usage: python3 bench/state_api.py [--services N] [--changes 50]
Writes bench/results/state_api-<N>.json and bench/results/state_api.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
for sub in ("agents", "api", "harness"):
    sys.path.insert(0, str(REPO / sub))

from kpx_agent.localnet import IP, Endpoint, ProxySettings  # noqa: E402
from kpx_agent.state_api.publisher import Publisher  # noqa: E402
from kpx_agent.state_api.server import Listen, StateServer  # noqa: E402
from workload import node_local_state  # noqa: E402

RESULTS = REPO / "bench" / "results"

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
    pub.publish(state, ProxySettings(), None)
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
        pub.publish(state, ProxySettings(), {key})
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


def report(r: dict[str, Any]) -> str:
    goal = "met" if float(r["change_to_handler_ms_median"]) < 50 else "NOT met"
    return "\n".join(
        [
            f"## Node-local state API, {r['services']:,} Service ports x 10 endpoints",
            "",
            "| measure | value |",
            "| --- | --- |",
            f"| full state, encoded | {int(r['full_state_bytes']) / 1e6:.1f} MB |",
            f"| publish the full state (convert + encode per port) | {r['publish_full_s']} s |",
            f"| assemble the full response (once per revision) | {r['encode_full_response_s']} s |",
            f"| full state to a new client's handler (incl. its start) | "
            f"{r['full_delivery_s_incl_client_start']} s |",
            f"| one change: publish (in the sync) | {r['publish_one_change_ms_median']} ms "
            "median |",
            f"| one change: end of sync -> client handler | {r['change_to_handler_ms_median']} ms "
            f"median, {r['change_to_handler_ms_p95']} ms p95 (goal < 50 ms median: {goal}) |",
            f"| server memory: the published state | {r['server_rss_state_kib']} KiB |",
            f"| server memory: 1 client | +{r['server_rss_extra_1_client_kib']} KiB |",
            f"| server memory: 10 clients | +{r['server_rss_extra_10_clients_kib']} KiB |",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=50)
    args = parser.parse_args()
    result = measure(args.services, args.changes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"state_api-{args.services}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    (RESULTS / "state_api.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
