"""Shared pieces of the kpx benchmarks: a throwaway control plane, a fast admin API client,
object builders, process statistics and the results files.

Every benchmark brings up its own control plane, named ``bench-<pid>`` under the default root,
so it never touches the ``kpx`` cluster a developer may have running, and tears it down on
exit, on an exception and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kpx_cluster.binaries import KUBERNETES_VERSION
from kpx_cluster.controlplane import Cluster
from kpx_kube import ApiError, Client, from_kubeconfig
from kpx_kube.blocking import BlockingClient

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
LATEST_MD = RESULTS_DIR / "latest.md"

SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Obj = dict[str, Any]
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


# ---- interruption and the control plane --------------------------------------------------------


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind the stack like SIGINT does, so every `finally` cleans up.

    Call it again after creating a kpx_cluster Topology: the Topology installs its own
    handlers, which (as of this writing) end the process with the default action after
    cleaning up the topology, so the control plane's `finally` would never run.
    """
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def bench_cluster(tag: str = "bench") -> Iterator[Cluster]:
    """A fresh local control plane (etcd, apiserver, controller-manager, scheduler), always
    stopped and removed afterwards."""
    cluster = Cluster(name=f"{tag}-{os.getpid()}")
    started = time.monotonic()
    try:
        cluster.up()
        log(f"control plane {cluster.name} up in {time.monotonic() - started:.1f}s")
        yield cluster
    finally:
        cluster.down()
        log(f"control plane {cluster.name} removed")


def component_pid(cluster: Cluster, name: str) -> int | None:
    """The pid of one control-plane component (from the cluster's state file)."""
    try:
        state = json.loads((cluster.state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None
    for comp in state.get("components", []):
        if comp.get("name") == name:
            return int(comp["pid"])
    return None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the admin API client ---------------------------------------------------------------------


class ApiClient:
    """The cluster's admin, through kpx_kube's client (kept-alive HTTPS connections, so
    `request` can be timed), with retries of throttling and transient failures. `many` sends
    a batch with `workers` requests in flight."""

    def __init__(self, cluster: Cluster, workers: int = 8) -> None:
        self.workers = workers
        self.kube = BlockingClient(
            from_kubeconfig(cluster.kubeconfig), user_agent="kpx-bench", connections=workers
        )

    def close(self) -> None:
        self.kube.close()

    async def _request(
        self,
        client: Client,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        content: str,
        attempts: int,
    ) -> Obj:
        for attempt in range(attempts):
            try:
                return (await client.request(method, path, body=body, content=content)).body
            except ApiError as exc:
                retry = exc.status == 0 or exc.status in RETRY_STATUSES
                if not retry or attempt == attempts - 1:
                    raise
            await asyncio.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content: str = "json",
        attempts: int = 6,
    ) -> Obj:
        """One request (`content`: "json", or for PATCH "merge", "strategic", ...)."""
        return self.kube.run(self._request(self.kube.client, method, path, body, content, attempts))

    def create(self, path: str, obj: Mapping[str, Any]) -> Obj:
        return self.request("POST", path, obj)

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> Obj:
        return self.request("PATCH", path, patch, "merge")

    def many(self, method: str, items: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Obj]:
        """Send every (path, body) with `method`, `workers` at a time; results in order."""
        content = "merge" if method == "PATCH" else "json"

        def call(path: str, body: Mapping[str, Any]) -> Callable[[Client], Awaitable[Obj]]:
            return lambda client: self._request(client, method, path, body, content, 6)

        return self.kube.many([call(path, body) for path, body in items], self.workers)


# ---- object builders ---------------------------------------------------------------------------


def namespace(name: str, labels: Mapping[str, str] | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": dict(labels or {})},
    }


def service(ns: str, name: str, port: int = 80, target_port: int = 8080) -> Obj:
    """A ClusterIP Service without selector (its EndpointSlice is ours to write)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "type": "ClusterIP",
            "ports": [{"name": "http", "port": port, "targetPort": target_port, "protocol": "TCP"}],
        },
    }


def endpoints(addresses: Sequence[tuple[str, str]]) -> list[Obj]:
    """Ready endpoints from (address, nodeName) pairs."""
    return [
        {"addresses": [ip], "nodeName": node, "conditions": {"ready": True}}
        for ip, node in addresses
    ]


def endpoint_slice(
    ns: str, svc: str, addresses: Sequence[tuple[str, str]], port: int = 8080
) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc}-1",
            "namespace": ns,
            "labels": {SERVICE_NAME_LABEL: svc},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints(addresses),
    }


def services_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/services"


def slices_path(ns: str, name: str = "") -> str:
    base = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    return f"{base}/{name}" if name else base


# ---- processes ---------------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_busy_idle() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, idle


def wait_until_quiet(busy_below: float = 0.2, window: float = 0.5, limit: float = 15.0) -> float:
    """Wait until the machine's CPUs were less than `busy_below` busy over a `window` (the
    kernel tears a deleted network namespace down after `ip netns del` returns, and a stopped
    process's memory is freed meanwhile: a cold start right after the previous one would race
    with both). Returns the seconds waited (at most about `limit`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        busy0, idle0 = _cpu_busy_idle()
        time.sleep(window)
        busy1, idle1 = _cpu_busy_idle()
        total = (busy1 - busy0) + (idle1 - idle0)
        if total and (busy1 - busy0) / total < busy_below:
            break
    return time.monotonic() - t0


def proc_memory_kb(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of a process, in kB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0])
    return out


def proc_cpu_seconds(pid: int) -> tuple[float, float]:
    """(own user+system CPU seconds, CPU seconds of its waited-for children such as `nft`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # Fields after the command: state is [0]; utime, stime, cutime, cstime are [11:15].
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS


# ---- statistics and reporting ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, str]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    nft = subprocess.run(["nft", "--version"], capture_output=True, text=True, check=False)
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "agent_commit": agent_commit(),
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "memory_gb": f"{mem_kb / 1024 / 1024:.0f}",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nft": nft.stdout.strip(),
        "kubernetes": KUBERNETES_VERSION,
    }


def agent_commit() -> str:
    """The commit the agent ran from, with `+dirty` when agents/, kube/ or api/ have uncommitted
    changes."""
    repo = BENCH_DIR.parent
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--", "agents", "kube", "api"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{head or 'unknown'}{'+dirty' if dirty else ''}"


AGENT_SOURCE_DIRS = ("api", "kube", "agents")
_compiled: set[Path] = set()


def compile_agent_sources(tree: Path) -> None:
    """Byte-compile the agent's sources of a tree (api/, kube/, agents/) into their
    __pycache__, as the agent image does at build time (images/Containerfile), so that a
    measured start reads bytecode as the image's does: where PYTHONDONTWRITEBYTECODE is set,
    the interpreter would otherwise compile every module from source at each start (about
    0.2 s of a start on the 2-core lab machine). Once per tree and process."""
    tree = tree.resolve()
    if tree in _compiled:
        return
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0"]
        + [str(tree / d) for d in AGENT_SOURCE_DIRS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    _compiled.add(tree)


def machine_line(info: Mapping[str, str]) -> str:
    return (
        f"{info['cores']} cores ({info['cpu'] or 'unknown CPU'}), {info['memory_gb']} GB, "
        f"kernel {info['kernel']}, Python {info['python']}, {info['nft']}, "
        f"control plane {info['kubernetes']}; agent at commit {info['agent_commit']}"
    )


def write_json(name: str, data: Mapping[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


_SECTION_RE = re.compile(r"<!-- section:(?P<id>[\w.-]+) -->\n.*?<!-- /section:(?P=id) -->\n", re.S)
LATEST_HEADER = (
    "# Latest benchmark results\n\n"
    "Written by `bench/compare.py` (each run replaces its own section; sections of benchmarks "
    "no longer in the tree stay as they were written). See docs/benchmarks.md for what is "
    "measured and how.\n\n"
)


def update_latest(section_id: str, markdown: str) -> Path:
    """Put `markdown` into bench/results/latest.md as section `section_id`, replacing the
    section of a previous run and keeping the others, ordered by id."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    text = LATEST_MD.read_text() if LATEST_MD.exists() else ""
    sections = {m["id"]: m.group(0) for m in _SECTION_RE.finditer(text)}
    sections[section_id] = (
        f"<!-- section:{section_id} -->\n{markdown.rstrip()}\n<!-- /section:{section_id} -->\n"
    )
    body = "\n".join(sections[k] for k in sorted(sections, key=_section_order))
    LATEST_MD.write_text(LATEST_HEADER + body)
    return LATEST_MD


def _section_order(section_id: str) -> tuple[str, int]:
    name, _, size = section_id.rpartition("-")
    return (name, int(size)) if size.isdigit() else (section_id, 0)


class LineHelper:
    """A helper script run inside a node netns that answers one line per request line
    (bench/kernel_probe.py); it prints "ready" once started."""

    def __init__(self, topo: Any, node: Any, script: Path) -> None:
        import sys

        self.name = script.name
        self.proc = topo.run(
            node, [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        if self._out.readline().strip() != b"ready":
            raise RuntimeError(f"bench/{self.name} did not start")

    def ask(self, request: str) -> str:
        self._in.write(request.encode() + b"\n")
        self._in.flush()
        line = self._out.readline().decode().strip()
        if not line or line.startswith("error"):
            raise RuntimeError(f"{self.name} {request!r}: {line or 'exited'}")
        return line

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._in.close()  # the helper exits at end of input
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._out.close()
