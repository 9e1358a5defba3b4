"""End-to-end harness for the node agent: a real apiserver, simulated nodes, real packets.

What it gives a test module (the fixtures in conftest.py wrap it):

* `Kube`: Kubernetes objects from plain dicts (`apply`, `apply_now`, `get`, `label`,
  `patch_status`, `delete`), through kpx_kube's client; `kubectl` for tests of kubectl itself.
* Object builders: `namespace`, `service`, `service_port`, `endpoint_slice`, `endpoint`,
  `node_object`.
* `AgentEnv`: one Topology (nodes n1 and n2, backend pods b1 on n1 and b2 on n2 answering on
  TCP and UDP 8080 as ``b1``/``b2`` and on 9090 as ``b1-9090``/``b2-9090``, a client pod on
  n1), Node objects whose InternalIPs are the nodes' fabric addresses, the apiserver exposed
  inside every node at 127.0.0.1:<apiserver port>, and one agent on n1 (`env.agent`).
* `AgentProcess`: start, SIGTERM (`stop`), SIGKILL (`kill`), /healthz, /metrics, its log.
* `TrafficWatch`: a client that connects to one address every few milliseconds and reports
  which backend answered each try, with wall-clock timestamps (to time rule changes).
* `wait_until`, `nft_ruleset`, `kpx_tables`, `metric`.

Set KPX_E2E_AGENT_VERBOSE=1 to start agents with -v (their logs are in the topology's temporary
directory and their tails appear in assertion messages).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kpx_cluster.controlplane import Cluster
from kpx_cluster.kubeconfig import write_kubeconfig
from kpx_cluster.netns import Node, Pod, Target, Topology, leftovers
from kpx_cluster.pki import KeyPair
from kpx_cluster.probe import ProbeResult, probe
from kpx_kube import from_kubeconfig
from kpx_kube.blocking import BlockingClient
from kpx_kube.kinds import BUILTIN

REPO = Path(__file__).resolve().parents[2]
AGENT_PYTHONPATH = os.pathsep.join(str(REPO / d) for d in ("agents", "kube", "api", "harness"))

OPT_OUT_LABEL = "networking.k8s.io/kube-proxy"
OPT_OUT_VALUE = "disabled"
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
FIELD_MANAGER = "kpx-e2e"

CLUSTER_CIDRS = ("10.244.0.0/16", "fd00:244::/32")
HEALTHZ = "127.0.0.1:10256"
METRICS = "127.0.0.1:10249"
BACKEND_PORT = 8080
SECOND_PORT = 9090

T = TypeVar("T")
Obj = dict[str, Any]


# ---- waiting ------------------------------------------------------------------------------------


def wait_until(
    check: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Call `check` until it returns something truthy (returned); AssertionError after
    `timeout` seconds, naming `message` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"{text} (within {timeout}s; last: {value!r})")
        time.sleep(interval)


# ---- Kubernetes objects -------------------------------------------------------------------------


def namespace(name: str, labels: Mapping[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name}
    if labels:
        meta["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def service_port(
    name: str, port: int, target_port: int, protocol: str = "TCP", node_port: int | None = None
) -> Obj:
    out: Obj = {"name": name, "port": port, "targetPort": target_port, "protocol": protocol}
    if node_port is not None:
        out["nodePort"] = node_port
    return out


def service(
    name: str,
    ns: str,
    ports: Sequence[Obj],
    *,
    type: str = "ClusterIP",
    labels: Mapping[str, str] | None = None,
    external_ips: Sequence[str] = (),
    ip_family_policy: str | None = None,
    ip_families: Sequence[str] = (),
    extra_spec: Mapping[str, Any] | None = None,
) -> Obj:
    """A Service without a selector: its EndpointSlices are written by the test."""
    meta: Obj = {"name": name, "namespace": ns}
    if labels:
        meta["labels"] = dict(labels)
    spec: Obj = {"type": type, "ports": list(ports)}
    if external_ips:
        spec["externalIPs"] = list(external_ips)
    if ip_family_policy:
        spec["ipFamilyPolicy"] = ip_family_policy
    if ip_families:
        spec["ipFamilies"] = list(ip_families)
    spec.update(extra_spec or {})
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def endpoint(
    address: str,
    node_name: str,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool | None = None,
) -> Obj:
    cond: Obj = {"ready": ready}
    if serving is not None:
        cond["serving"] = serving
    if terminating is not None:
        cond["terminating"] = terminating
    return {"addresses": [address], "nodeName": node_name, "conditions": cond}


def endpoint_slice(
    name: str,
    ns: str,
    service_name: str,
    endpoints: Sequence[Obj],
    ports: Sequence[tuple[str, int, str]],
    *,
    address_type: str = "IPv4",
    trigger_time: datetime.datetime | None = None,
) -> Obj:
    """An EndpointSlice of `service_name`; `ports` are (name, port, protocol), the names
    matching the Service's port names."""
    meta: Obj = {"name": name, "namespace": ns, "labels": {SERVICE_NAME_LABEL: service_name}}
    if trigger_time is not None:
        # RFC 3339 with fractions, as the EndpointSlice controller writes it: a stamp cut to the
        # second can fall before an agent started within that second, which ignores it (as
        # upstream ignores trigger times from before the proxy started).
        stamp = trigger_time.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        meta["annotations"] = {TRIGGER_ANNOTATION: stamp}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": address_type,
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
        "endpoints": list(endpoints),
    }


def node_object(node: Node) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
        "spec": {"podCIDRs": [node.pod_cidr_v4, node.pod_cidr_v6]},
    }


def node_addresses(node: Node) -> Obj:
    """The status patch giving `node` its InternalIPs (the fabric addresses)."""
    return {
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node.ipv4},
                {"type": "InternalIP", "address": node.ipv6},
                {"type": "Hostname", "address": node.name},
            ]
        }
    }


#: kubectl's names for the kinds the tests name ("service", "endpointslice", ...).
_KINDS = {k.kind.lower(): k for k in BUILTIN.values()}


class Kube:
    """Kubernetes objects as dicts, through kpx_kube's client as the cluster's admin
    (`kubectl` is there for tests that check kubectl's own behaviour)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._client: BlockingClient | None = None

    @property
    def client(self) -> BlockingClient:
        if self._client is None:
            self._client = BlockingClient(
                from_kubeconfig(self.cluster.kubeconfig), user_agent=FIELD_MANAGER
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, input=input, check=check)

    def path(self, kind: str, name: str, ns: str | None = None) -> str:
        """The REST path of the object of a kind named as kubectl names it (e.g. "service")."""
        k = _KINDS[kind.lower()]
        meta = {"name": name, **({"namespace": ns} if ns else {})}
        return self.client.path_of({"apiVersion": k.api_version, "kind": k.kind, "metadata": meta})

    def apply(self, *objs: Mapping[str, Any]) -> None:
        """Server-side apply `objs` in order (force, field manager kpx-e2e)."""
        for obj in objs:
            self.apply_now(obj)

    def get(self, kind: str, name: str, ns: str | None = None) -> Obj:
        """The object (NotFound if it does not exist)."""
        return self.client.get(self.path(kind, name, ns))

    def delete(self, kind: str, name: str, ns: str | None = None, wait: bool = False) -> None:
        """Delete if it exists; with `wait`, until it is gone (finalizers done)."""
        path = self.path(kind, name, ns)
        if self.client.delete(path, missing_ok=True) and wait:
            wait_until(lambda: self.client.get_or_none(path) is None, 120, 0.2, f"{path} stays")

    def label(
        self, kind: str, name: str, labels: Mapping[str, str | None], ns: str | None = None
    ) -> None:
        """Set labels; a None value removes that label."""
        self.client.patch(self.path(kind, name, ns), {"metadata": {"labels": dict(labels)}})

    def patch_status(
        self, kind: str, name: str, patch: Mapping[str, Any], ns: str | None = None
    ) -> None:
        """Merge-patch the status subresource (a create cannot set status)."""
        self.client.patch(self.path(kind, name, ns) + "/status", dict(patch))

    def apply_now(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply one object with a single request; returns the stored object."""
        return self.client.apply_object(obj, field_manager=FIELD_MANAGER, force=True).body

    # -- conveniences ---------------------------------------------------------------------------

    def register_node(self, node: Node) -> None:
        """Create (or update) the Node object of a topology node, with its InternalIPs."""
        self.apply(node_object(node))
        self.patch_status("node", node.name, node_addresses(node))

    def create_namespace(self, labels: Mapping[str, str] | None = None, prefix: str = "t") -> str:
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.apply(namespace(name, labels))
        return name


# ---- nftables and metrics -----------------------------------------------------------------------


def nft_ruleset(topology: Topology, target: Target) -> str:
    return topology.exec(target, ["nft", "list", "ruleset"], check=True).stdout


def kpx_tables(topology: Topology, target: Target) -> set[str]:
    """The kpx tables in `target`'s netns, as 'family name' strings (e.g. 'ip kpx')."""
    out = topology.exec(target, ["nft", "list", "tables"], check=True).stdout
    tables = {line.removeprefix("table ").strip() for line in out.splitlines() if line.strip()}
    return {t for t in tables if t.split()[-1] == "kpx"}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples `name` that have these labels (`le` included for buckets; the
    others, such as ip_family, summed over); None when there is none."""
    found = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                found = (found or 0.0) + float(sample.value)
    return found


# ---- the agent ----------------------------------------------------------------------------------


def write_agent_config(
    path: Path,
    mode: str = "nftables",
    min_sync_period: str = "100ms",
    sync_period: str = "30s",
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """An AgentConfiguration file for `mode`."""
    config: Obj = {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "AgentConfiguration",
        "mode": mode,
        mode: {"syncPeriod": sync_period, "minSyncPeriod": min_sync_period},
    }
    if mode == "ipvs":
        config[mode]["acknowledgeDeprecation"] = True
    config.update(extra or {})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_agent_kubeconfig(
    cluster: Cluster, path: Path, user: str | None = None, groups: tuple[str, ...] = ()
) -> Path:
    """A kubeconfig reaching the apiserver at 127.0.0.1:<port>, which is where
    `Topology.expose_host_port` relays it inside every node. Admin credentials unless `user`."""
    if user is not None:
        return cluster.client_kubeconfig(user, groups, path)
    admin = KeyPair(cluster.pki_dir / "admin.crt", cluster.pki_dir / "admin.key")
    return write_kubeconfig(
        path,
        server=f"https://127.0.0.1:{cluster.apiserver_port}",
        ca=cluster.ca_file,
        user="admin",
        client=admin,
    )


@dataclass
class AgentProcess:
    """One `proxy-agent` process running in a node's netns."""

    topology: Topology
    node: Node
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    healthz: str = HEALTHZ
    metrics_address: str = METRICS

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal(self, sig: int, timeout: float) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # its own session: only the agent's group
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: a clean stop (the rules stay for the next agent); the exit code. Within the
        kubelet's default grace period (terminationGracePeriodSeconds, 30 s), as on a node: a
        sync running in a worker thread when the signal comes finishes first."""
        return self._signal(signal.SIGTERM, timeout)

    def kill(self) -> int:
        """SIGKILL: a crash."""
        return self._signal(signal.SIGKILL, 5.0)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def http_get(self, address: str, path: str, timeout: float = 2.0) -> tuple[int, str]:
        """GET http://address/path from inside the node; (status, body), status 0 if no answer."""
        code = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
            "    status, body = r.status, r.read()\n"
            "except urllib.error.HTTPError as e:\n"
            "    status, body = e.code, e.read()\n"
            "except OSError as e:\n"
            "    status, body = 0, str(e).encode()\n"
            "sys.stdout.write(f'{status}\\n'); sys.stdout.flush()\n"
            "sys.stdout.buffer.write(body)\n"
        )
        argv = [sys.executable, "-c", code, f"http://{address}{path}", str(timeout)]
        res = self.topology.exec(self.node, argv, timeout=timeout + 10)
        status, _, body = res.stdout.partition("\n")
        return (int(status) if status.strip().isdigit() else 0), body

    def healthz_status(self) -> int:
        return self.http_get(self.healthz, "/healthz")[0]

    def metrics(self) -> str:
        status, body = self.http_get(self.metrics_address, "/metrics")
        assert status == 200, f"/metrics answered {status}: {body[:300]}\n{self.log_tail()}"
        return body

    def metric(self, name: str, **labels: str) -> float | None:
        return metric(self.metrics(), name, **labels)

    def synced(self) -> bool:
        """A sync programmed the kernel (its metrics say when the last one succeeded)."""
        status, body = self.http_get(self.metrics_address, "/metrics")
        if status != 200:
            return False
        return bool(metric(body, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"))

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until the first sync is done and /healthz answers 200. /healthz alone does not say
        it: as upstream's, it is 200 from the start until a change waits too long."""

        def healthy() -> bool:
            if not self.alive():
                raise AssertionError(
                    f"agent on {self.node.name} exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            return self.synced() and self.healthz_status() == 200

        wait_until(
            healthy,
            timeout,
            interval=0.2,
            message=lambda: f"agent on {self.node.name} never healthy:\n{self.log_tail()}",
        )


def start_agent(
    topology: Topology,
    node: Node,
    kubeconfig: Path | None,
    *,
    mode: str = "nftables",
    config: Path | None = None,
    cluster_cidrs: Sequence[str] = CLUSTER_CIDRS,
    extra_args: Sequence[str] = (),
    wait: bool = True,
    timeout: float = 30.0,
    env_extra: Mapping[str, str] | None = None,
) -> AgentProcess:
    """Start `proxy-agent` in `node`'s netns (its output in a log file under the topology's
    temporary directory); with `wait`, return once the first sync is done and /healthz
    answers 200. Without a kubeconfig the agent uses in-cluster credentials (`env_extra`
    says where: KUBERNETES_SERVICE_HOST, KPX_SERVICEACCOUNT_DIR, ...)."""
    argv = [sys.executable, "-m", "kpx_agent.cli", "--mode", mode, "--node-name", node.name]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig)]
    for cidr in cluster_cidrs:
        argv += ["--cluster-cidr", cidr]
    if config is not None:
        argv += ["--config", str(config)]
    argv += list(extra_args)
    if os.environ.get("KPX_E2E_AGENT_VERBOSE") and "-v" not in argv:
        argv.append("-v")  # debug logging: each sync, full or partial
    log_path = topology.tmpdir / f"agent-{node.name}-{secrets.token_hex(2)}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (AGENT_PYTHONPATH, env.get("PYTHONPATH", "")) if p
    )
    env.update(env_extra or {})
    with log_path.open("wb") as log:
        proc = topology.run(
            node, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    agent = AgentProcess(topology, node, proc, log_path, argv)
    if wait:
        try:
            agent.wait_healthy(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                agent.kill()
            raise
    return agent


def run_cleanup(
    topology: Topology, node: Node, mode: str = "nftables"
) -> subprocess.CompletedProcess[str]:
    """`proxy-agent cleanup --mode MODE` inside `node`."""
    argv = ["env", f"PYTHONPATH={AGENT_PYTHONPATH}", sys.executable, "-m", "kpx_agent.cli"]
    return topology.exec(node, [*argv, "cleanup", "--mode", mode], timeout=30)


# ---- timing traffic -----------------------------------------------------------------------------

_WATCH_CODE = """
import sys, time
from kpx_cluster.probe import run_probe
host, port, proto = sys.argv[1], int(sys.argv[2]), sys.argv[3]
interval, timeout = float(sys.argv[4]), float(sys.argv[5])
print("ready", flush=True)
while True:
    t = time.time()
    r = run_probe(host, port, proto, 1, timeout)
    what = next(iter(r.answers), None)
    if what is None:
        what = "refused" if r.refused else "timeout" if r.timeout else "error"
    print(f"{t:.6f} {what}", flush=True)
    time.sleep(interval)
"""


@dataclass
class TrafficWatch:
    """A client in a pod connecting to host:port every `interval` seconds; `events` are
    (wall-clock time the try started, backend name | 'refused' | 'timeout' | 'error')."""

    proc: subprocess.Popen[bytes]
    events: list[tuple[float, str]] = field(default_factory=list)
    _buf: bytes = b""

    @classmethod
    def start(
        cls,
        topology: Topology,
        pod: Pod,
        host: str,
        port: int,
        proto: str = "tcp",
        interval: float = 0.01,
        timeout: float = 0.3,
    ) -> TrafficWatch:
        argv = [sys.executable, "-c", _WATCH_CODE, host, str(port), proto]
        argv += [str(interval), str(timeout)]
        proc = topology.run(pod, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        watch = cls(proc)
        watch._read_until(lambda: b"ready\n" in watch._buf, 15.0, parse=False)
        watch._buf = watch._buf.split(b"ready\n", 1)[1]
        return watch

    def _read_until(self, done: Callable[[], bool], timeout: float, parse: bool = True) -> bool:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.05))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"traffic watch exited ({self.proc.wait(5)})")
            self._buf += chunk
            if parse:
                *lines, self._buf = self._buf.split(b"\n")
                for line in lines:
                    stamp, _, what = line.decode().partition(" ")
                    self.events.append((float(stamp), what))
        return True

    def wait_for(
        self, condition: Callable[[list[tuple[float, str]]], float | None], timeout: float
    ) -> float | None:
        """Read events until `condition(events)` returns a time (returned) or `timeout`."""
        found: list[float | None] = [None]

        def done() -> bool:
            found[0] = condition(self.events)
            return found[0] is not None

        self._read_until(done, timeout)
        return found[0]

    def since(self, t0: float) -> list[tuple[float, str]]:
        return [e for e in self.events if e[0] >= t0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def first_seen(name: str, t0: float) -> Callable[[list[tuple[float, str]]], float | None]:
    """Condition: the start time of the first try after `t0` answered by `name`."""

    def cond(events: list[tuple[float, str]]) -> float | None:
        return next((t for t, what in events if t >= t0 and what == name), None)

    return cond


def gone_for(
    name: str, t0: float, streak: int = 25
) -> Callable[[list[tuple[float, str]]], float | None]:
    """Condition: after `t0`, `streak` answered tries in a row none of which `name` answered;
    the start time of the first of them (the first try after the last `name` answer)."""

    def cond(events: list[tuple[float, str]]) -> float | None:
        run: list[float] = []
        for t, what in events:
            if t < t0:
                continue
            if what == name or what in ("refused", "timeout", "error"):
                run = []
            else:
                run.append(t)
        return run[0] if len(run) >= streak else None

    return cond


# ---- the shared environment ---------------------------------------------------------------------


@dataclass
class AgentEnv:
    """See the module docstring. `agent` is the agent on n1; tests may replace it."""

    cluster: Cluster
    kube: Kube
    topology: Topology
    mode: str
    nodes: dict[str, Node]
    pods: dict[str, Pod]
    kubeconfig: Path
    config: Path
    agent: AgentProcess | None = None
    extra_agents: list[AgentProcess] = field(default_factory=list)

    @property
    def n1(self) -> Node:
        return self.nodes["n1"]

    @property
    def n2(self) -> Node:
        return self.nodes["n2"]

    @property
    def client(self) -> Pod:
        return self.pods["client"]

    def backend_endpoints(self, family: int = 4, names: Sequence[str] = ("b1", "b2")) -> list[Obj]:
        """EndpointSlice endpoints for these backend pods."""
        out = []
        for name in names:
            pod = self.pods[name]
            out.append(endpoint(pod.ipv4 if family == 4 else pod.ipv6, pod.node.name))
        return out

    def start_agent(self, node: str = "n1", **kwargs: Any) -> AgentProcess:
        """Start an agent on `node` with the environment's kubeconfig and config file; the
        agent on n1 becomes `env.agent`, others are tracked and stopped at teardown."""
        kwargs.setdefault("mode", self.mode)
        kwargs.setdefault("config", self.config)
        agent = start_agent(self.topology, self.nodes[node], self.kubeconfig, **kwargs)
        if node == "n1":
            self.agent = agent
        else:
            self.extra_agents.append(agent)
        return agent

    def probe(
        self,
        host: str,
        port: int,
        proto: str = "tcp",
        count: int = 20,
        timeout: float = 1.0,
        source: Target | None = None,
    ) -> ProbeResult:
        return probe(
            self.topology, source or self.client, host, port, proto, count=count, timeout=timeout
        )

    def close(self) -> None:
        for agent in [*self.extra_agents, *([self.agent] if self.agent else [])]:
            with contextlib.suppress(Exception):
                agent.stop(timeout=5)
            with contextlib.suppress(Exception):
                agent.kill()
        self.topology.cleanup()
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                self.kube.delete("node", node.name)


@contextlib.contextmanager
def build_agent_env(
    cluster: Cluster, mode: str = "nftables", start: bool = True
) -> Iterator[AgentEnv]:
    """Build the shared environment (see the module docstring); torn down on exit, and the
    teardown fails if the topology leaked anything."""
    kube = Kube(cluster)
    topo = Topology()
    env: AgentEnv | None = None
    try:
        nodes = {name: topo.add_node(name) for name in ("n1", "n2")}
        topo.expose_host_port(cluster.apiserver_port)
        pods = {
            "b1": topo.add_pod(nodes["n1"], "b1"),
            "b2": topo.add_pod(nodes["n2"], "b2"),
            "client": topo.add_pod(nodes["n1"], "client"),
        }
        for name in ("b1", "b2"):
            for port, answer in ((BACKEND_PORT, name), (SECOND_PORT, f"{name}-{SECOND_PORT}")):
                argv = topo.python_argv("kpx_cluster.echo_server", "--name", answer)
                topo.run_ready(pods[name], [*argv, "--port", str(port)])
        for node in nodes.values():
            kube.register_node(node)
        env = AgentEnv(
            cluster=cluster,
            kube=kube,
            topology=topo,
            mode=mode,
            nodes=nodes,
            pods=pods,
            kubeconfig=write_agent_kubeconfig(cluster, topo.tmpdir / "agent.kubeconfig"),
            config=write_agent_config(topo.tmpdir / "agent-config.yaml", mode),
        )
        if start:
            env.start_agent("n1")
        yield env
    finally:
        if env is not None:
            env.close()
        else:
            topo.cleanup()
        kube.close()
    left = leftovers(topo.prefix)
    assert not left, f"topology {topo.prefix} leaked: {left}"


# ---- appended for the shared Service-semantics matrix (test_service_semantics.py) ---------------


def kernel_rules(topology: Topology, target: Target) -> str:
    """Everything a proxy mode may have programmed in `target`'s netns, as text: the nftables
    ruleset plus `iptables-save` and `ip6tables-save` (whichever flavour is installed)."""
    parts = [topology.exec(target, ["nft", "list", "ruleset"], check=True).stdout]
    for tool in ("iptables-save", "ip6tables-save"):
        parts.append(topology.exec(target, [tool], check=False).stdout)
    return "\n".join(parts)


def iptables_chains(topology: Topology, target: Target, prefix: str = "KPX-") -> set[str]:
    """Names of the iptables/ip6tables chains starting with `prefix` in `target`'s netns, as
    '<family> <table> <chain>' strings (e.g. '4 nat KPX-SERVICES')."""
    found: set[str] = set()
    for family, tool in ((4, "iptables-save"), (6, "ip6tables-save")):
        table = ""
        for line in topology.exec(target, [tool], check=False).stdout.splitlines():
            if line.startswith("*"):
                table = line[1:].strip()
            elif line.startswith(":") and line[1:].startswith(prefix):
                found.add(f"{family} {table} {line[1:].split()[0]}")
    return found


_UDP_SOCKET_WATCH_CODE = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
interval, timeout = float(sys.argv[3]), float(sys.argv[4])
sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
sock.connect((host, port))
print("ready", flush=True)
while True:
    sock.setblocking(False)
    while True:  # late replies and queued ICMP errors of earlier tries
        try:
            sock.recv(4096)
        except BlockingIOError:
            break
        except OSError:
            continue
    sock.settimeout(timeout)
    t = time.time()
    try:
        sock.send(b"kpx-probe\\n")
        words = sock.recv(4096).decode(errors="replace").split()
        what = words[0] if words else "error"
    except ConnectionRefusedError:
        what = "refused"
    except TimeoutError:
        what = "timeout"
    except OSError:
        what = "error"
    print(f"{t:.6f} {what}", flush=True)
    time.sleep(interval)
"""


def start_udp_socket_watch(
    topology: Topology,
    target: Target,
    host: str,
    port: int,
    interval: float = 0.05,
    timeout: float = 0.25,
) -> TrafficWatch:
    """Like `TrafficWatch.start` for UDP, but every try is a datagram on ONE connected socket
    (one source port, so one conntrack entry for the whole run): what a long-lived UDP client
    such as a DNS resolver or a metrics agent does. Events as in `TrafficWatch`."""
    argv = [sys.executable, "-c", _UDP_SOCKET_WATCH_CODE, host, str(port)]
    argv += [str(interval), str(timeout)]
    proc = topology.run(target, argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    watch = TrafficWatch(proc)
    watch._read_until(lambda: b"ready\n" in watch._buf, 15.0, parse=False)
    watch._buf = watch._buf.split(b"ready\n", 1)[1]
    return watch


@dataclass
class Svc:
    """A Service as the apiserver returned it: its name, cluster IPs and node ports."""

    obj: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    def ip(self, family: int = 4) -> str:
        ips = [str(ip) for ip in self.obj["spec"].get("clusterIPs") or []]
        matching = [ip for ip in ips if (":" in ip) == (family == 6)]
        assert matching, f"{self.name} has no IPv{family} cluster IP: {ips}"
        return matching[0]

    def node_port(self, port_name: str) -> int:
        for p in self.obj["spec"]["ports"]:
            if p["name"] == port_name:
                return int(p["nodePort"])
        raise AssertionError(f"{self.name} has no port {port_name}")
