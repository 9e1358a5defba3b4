"""A mode switch under load on a simulated cluster (issue #18, "proof under load").

`migration_cluster(cluster, mode)` installs kpx as a user would on three simulated nodes: the
CRDs, the operator's manifests (the operator and the agents run from the built images under
runc), one ProxyConfiguration in `mode`; backends (a Deployment, one pod per node, answering
TCP and UDP with `echo_server` and holding connections with `migration_load hold-server`), and
three Services on them (two ClusterIP, one NodePort). `switch(env, new_mode)` starts a load
client in a pod netns on every node (`migration_load client`: a new TCP connection every
`interval` s round-robin over the three ClusterIPs and the NodePort on every node, UDP
request/response the same way, `holds` connections held open), patches `spec.mode`, waits until
the agents' DaemonSet has rolled to the new mode on every node, the ProxyConfiguration is Ready
in it and no node has the old mode's rules left, stops the load and returns a `SwitchResult`.

Used by bench/migration.py (`make bench-migration`) and tests/e2e/test_migration_under_load.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kpx_cluster import node_events
from kpx_cluster.controlplane import Cluster
from kpx_cluster.kubelets import install as kubelets_install
from kpx_cluster.migration_load import Summary
from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.nodesim import NodeSimulator
from kpx_cluster.nodesim.runc import built_images

REPO = Path(__file__).resolve().parents[2]
NS = "kpx-system"
AGENT_LABEL = "app.kubernetes.io/name=kpx-agent"
TCP_PORT, UDP_PORT, HOLD_PORT = 80, 53, 81
BACKEND_PORT, BACKEND_HOLD_PORT = 8080, 7070
T = TypeVar("T")
#: The mode block of the ProxyConfiguration (examples/proxyconfig.yaml's, for either mode).
SYNC = {"syncPeriod": "30s", "minSyncPeriod": "1s"}


def wait_until(check: Callable[[], T | bool | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for: {what}")
        time.sleep(0.5)


@dataclass
class MigrationEnv:
    cluster: Cluster
    topo: Topology
    #: None on real kubelets (`kpx_cluster.migration_real`)
    sim: NodeSimulator | None
    nodes: list[Node]
    clients: list[Pod]
    pxc: str
    app_ns: str
    label: dict[str, str]

    @property
    def real_nodes(self) -> bool:
        """Real kubelets (`kpx_cluster.migration_real`), not the node simulator."""
        return self.sim is None

    def simulator(self) -> NodeSimulator:
        """The node simulator (what only it can do: find a pod's processes, its relay port)."""
        if self.sim is None:
            raise RuntimeError("this runs on the node simulator, not on real kubelets")
        return self.sim

    def json(self, *args: str) -> dict[str, Any]:
        out = self.cluster.kubectl(*args, "-o", "json", check=False)
        return dict(json.loads(out.stdout)) if out.returncode == 0 else {}

    def service(self, name: str) -> dict[str, Any]:
        return self.json("-n", self.app_ns, "get", "svc", name)

    def agent_pods(self) -> list[dict[str, Any]]:
        pods = self.json("-n", NS, "get", "pods", "-l", AGENT_LABEL)
        mine = {n.name for n in self.nodes}
        return [p for p in pods.get("items", []) if p["spec"].get("nodeName") in mine]

    def rolled_out(self, mode: str) -> bool:
        """Every node runs one Ready agent of `mode` (none terminating), and the
        ProxyConfiguration says Ready in `mode` on every node for its current generation."""
        pods = self.agent_pods()
        if len(pods) != len(self.nodes) or {p["spec"]["nodeName"] for p in pods} != {
            n.name for n in self.nodes
        }:
            return False
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or agent_mode(pod) != mode:
                return False
            conditions = pod.get("status", {}).get("conditions", [])
            if not any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return False
        pxc = self.json("get", "pxc", self.pxc)
        st = pxc.get("status", {})
        return bool(
            st.get("mode") == mode
            and st.get("observedGeneration") == pxc["metadata"]["generation"]
            and st.get("readyNodes") == len(self.nodes)
            and any(
                c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])
            )
        )

    def leftovers(self, mode: str) -> dict[str, list[str]]:
        """node -> what of kpx mode `mode` is in its netns (an empty dict: nothing anywhere)."""
        out = {}
        for node in self.nodes:
            found = mode_rules(self.topo, node, mode)
            if found:
                out[node.name] = found
        return out

    def patch_mode_switch(self, **fields: object) -> None:
        """spec.modeSwitch's fields (camelCase; None: back to the default)."""
        patch = {"spec": {"modeSwitch": fields}}
        self.cluster.kubectl("patch", "pxc", self.pxc, "--type=merge", "-p", json.dumps(patch))

    def patch_mode(self, old: str, new: str) -> None:
        """spec.mode to `new`, and the old mode's block to the new one's (only the block of the
        selected mode may be set)."""
        patch = {"spec": {"mode": new, old: None, new: dict(SYNC)}}
        self.cluster.kubectl("patch", "pxc", self.pxc, "--type=merge", "-p", json.dumps(patch))


def agent_mode(pod: dict[str, Any]) -> str:
    """The --mode of an agent pod's container."""
    for container in pod["spec"]["containers"]:
        argv = [*container.get("command", []), *container.get("args", [])]
        if "--mode" in argv:
            return str(argv[argv.index("--mode") + 1])
    return ""


def mode_rules(topo: Topology, node: Node, mode: str) -> list[str]:
    """What kpx mode `mode` programs that is in `node`'s netns: for iptables every chain or rule
    naming a KPX- chain (IPv4 and IPv6, the nf_tables and the legacy variant), for nftables
    every kpx table (`nft list tables`)."""
    found: list[str] = []
    if mode == "iptables":
        for tool in (
            "iptables-nft-save",
            "ip6tables-nft-save",
            "iptables-legacy-save",
            "ip6tables-legacy-save",
        ):
            out = topo.exec(node, [tool], check=False).stdout
            found += [f"{tool}: {line}" for line in out.splitlines() if "KPX-" in line]
    elif mode == "nftables":
        out = topo.exec(node, ["nft", "list", "tables"], check=True).stdout
        found += [line.strip() for line in out.splitlines() if line.split()[-1:] == ["kpx"]]
    else:
        raise ValueError(f"mode {mode!r}: leftovers are checked for iptables and nftables")
    return found


def _apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))


def proxy_configuration(name: str, mode: str, label: dict[str, str]) -> dict[str, Any]:
    pxc = yaml.safe_load((REPO / "examples" / "proxyconfig.yaml").read_text())
    pxc["metadata"]["name"] = name
    spec = pxc["spec"]
    spec["mode"] = mode
    spec.pop("nftables", None)
    spec[mode] = dict(SYNC)
    spec["nodeSelector"] = label
    spec["maxUnavailable"] = 1
    return dict(pxc)


REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def _app(cluster: Cluster, ns: str, label: dict[str, str], replicas: int) -> None:
    cluster.create_namespace(ns)
    for obj in app_objects(ns, label, replicas):
        _apply(cluster, obj)


def app_objects(ns: str, label: dict[str, str], replicas: int) -> list[dict[str, Any]]:
    """The backends' Deployment (images `echo` and `python`: the node simulator runs the
    harness's modules) and the three Services on them."""
    # One backend per node (the scheduler spreads them: a required anti-affinity on hostname).
    objs: list[dict[str, Any]] = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "nodeSelector": label,
                        "automountServiceAccountToken": False,
                        "affinity": {
                            "podAntiAffinity": {
                                REQUIRED: [
                                    {
                                        "labelSelector": {"matchLabels": {"app": "web"}},
                                        "topologyKey": "kubernetes.io/hostname",
                                    }
                                ]
                            }
                        },
                        "containers": [
                            {
                                "name": "echo",
                                "image": "echo",
                                "command": [
                                    "python3",
                                    "-m",
                                    "kpx_cluster.echo_server",
                                    "--name",
                                    "$(POD_NAME)",
                                    "--port",
                                    str(BACKEND_PORT),
                                ],
                                "env": [
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    }
                                ],
                                "readinessProbe": {
                                    "tcpSocket": {"port": BACKEND_PORT},
                                    "periodSeconds": 1,
                                },
                            },
                            {
                                "name": "hold",
                                "image": "python",
                                "command": [
                                    "python3",
                                    "-m",
                                    "kpx_cluster.migration_load",
                                    "hold-server",
                                    "--name",
                                    "$(POD_NAME)",
                                    "--port",
                                    str(BACKEND_HOLD_PORT),
                                ],
                                "env": [
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    }
                                ],
                                "readinessProbe": {
                                    "tcpSocket": {"port": BACKEND_HOLD_PORT},
                                    "periodSeconds": 1,
                                },
                            },
                        ],
                    },
                },
            },
        }
    ]
    ports = [
        {"name": "tcp", "port": TCP_PORT, "targetPort": BACKEND_PORT, "protocol": "TCP"},
        {"name": "udp", "port": UDP_PORT, "targetPort": BACKEND_PORT, "protocol": "UDP"},
        {"name": "hold", "port": HOLD_PORT, "targetPort": BACKEND_HOLD_PORT, "protocol": "TCP"},
    ]
    for name, kind in (("svc-a", "ClusterIP"), ("svc-b", "ClusterIP"), ("svc-np", "NodePort")):
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"type": kind, "selector": {"app": "web"}, "ports": ports},
            }
        )
    return objs


def _crd_established(cluster: Cluster) -> bool:
    got = cluster.kubectl(
        "get", "crd", "proxyconfigurations.proxy.kpx.dev", "-o", "json", check=False
    )
    conditions = (
        json.loads(got.stdout).get("status", {}).get("conditions") or [] if got.stdout else []
    )
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def apply_kpx(
    cluster: Cluster, label: dict[str, str], pxc: dict[str, Any], real_nodes: bool = False
) -> None:
    """The CRDs, the operator's manifests (its Deployment on the nodes labelled `label`) and
    the ProxyConfiguration `pxc`. `real_nodes`: the operator is pointed at the apiserver's
    address, as `kubelets.install` does."""
    cluster.wait_namespace_settled(NS)
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    # (not `kubectl wait`: on a fresh control plane the CRD may have no conditions yet,
    # which it reports as an error)
    wait_until(lambda: _crd_established(cluster), 60, "the CRD Established")
    if real_nodes:
        for doc in kubelets_install.operator_manifests(cluster):
            _apply(cluster, doc)
    else:
        cluster.kubectl("apply", "-k", str(REPO / "operator" / "manifests"))
    cluster.kubectl(
        "-n",
        NS,
        "patch",
        "deploy",
        "kpx-operator",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"template": {"spec": {"nodeSelector": label}}}}),
    )
    _apply(cluster, pxc)


def remove_kpx(cluster: Cluster, pxc: str, app_ns: str) -> None:
    """The ProxyConfiguration, the app's namespace, the operator and its manifests."""
    for args in (
        ("delete", "pxc", pxc, "--ignore-not-found", "--timeout=120s"),
        ("delete", "namespace", app_ns, "--ignore-not-found", "--wait=false"),
        ("-n", NS, "delete", "deploy", "kpx-operator", "--ignore-not-found"),
        (
            "delete",
            "-k",
            str(REPO / "operator" / "manifests"),
            "--ignore-not-found",
            "--wait=false",
        ),
    ):
        cluster.kubectl(*args, check=False, timeout=150)


def wait_backends_ready(env: MigrationEnv, nodes: int) -> None:
    wait_until(
        lambda: (
            env.json("-n", env.app_ns, "get", "deploy", "web")
            .get("status", {})
            .get("readyReplicas")
            == nodes
        ),
        120,
        "the backends ready",
    )


@contextlib.contextmanager
def migration_cluster(
    cluster: Cluster, mode: str, nodes: int = 3, log: Callable[[str], None] = print
) -> Iterator[MigrationEnv]:
    """kpx in `mode` on `nodes` simulated nodes, the app and a client pod netns per node."""
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-migration": run}
    pxc, app_ns = f"migration-{run}", f"kpx-migration-{run}"
    store = built_images()
    with Topology() as topo:
        sim = NodeSimulator(cluster, topo, pod_apiserver_access=True, runtime="runc", images=store)
        try:
            sim_nodes = [sim.add_node(f"m{run}-{i}", labels=label) for i in range(1, nodes + 1)]
            apply_kpx(cluster, label, proxy_configuration(pxc, mode, label))
            _app(cluster, app_ns, label, nodes)
            clients = [topo.add_pod(node, f"load-{i}") for i, node in enumerate(sim_nodes)]
            env = MigrationEnv(cluster, topo, sim, sim_nodes, clients, pxc, app_ns, label)
            log(f"waiting for kpx ({mode}) on {nodes} nodes and the backends")
            wait_until(lambda: env.rolled_out(mode), 240, f"{pxc} Ready in {mode}")
            wait_backends_ready(env, nodes)
            yield env
        finally:
            remove_kpx(cluster, pxc, app_ns)
            sim.stop(delete_nodes=True)


@dataclass
class SwitchResult:
    old: str
    new: str
    nodes: int
    #: from the patch to every node serving in the new mode with the old mode's rules gone (s)
    duration: float
    loads: list[Summary]
    leftovers: dict[str, list[str]]
    #: node -> seconds after the patch when its new agent was Ready
    node_ready: dict[str, float] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"{self.old} -> {self.new}"

    def total(self, kind: str, what: str) -> int:
        return sum(getattr(getattr(s, kind), what) for s in self.loads)

    @property
    def held(self) -> int:
        return sum(len(s.held) for s in self.loads)

    @property
    def held_survived(self) -> int:
        return sum(s.held_survived for s in self.loads)

    @property
    def load_seconds(self) -> float:
        return max((s.duration for s in self.loads), default=0.0)

    def failures(self) -> list[str]:
        """Every way this switch was not clean (empty: zero failures, no leftovers)."""
        out = []
        for i, s in enumerate(self.loads):
            if s.tcp.failed:
                out.append(
                    f"client {i}: {s.tcp.failed} of {s.tcp.tried} new connections "
                    f"failed: {s.tcp.failures[:5]}"
                )
            if s.udp.failed:
                out.append(
                    f"client {i}: {s.udp.failed} of {s.udp.tried} UDP exchanges lost: "
                    f"{s.udp.failures[:5]}"
                )
            out += [
                f"client {i}: held connection broke: {h.error or h.backends}"
                for h in s.held
                if not h.survived
            ]
        out += [
            f"{node}: {len(found)} {self.old} leftovers, e.g. {found[:3]}"
            for node, found in self.leftovers.items()
        ]
        return out


def _targets(env: MigrationEnv) -> tuple[list[str], list[str], str]:
    ips = [env.service(name)["spec"]["clusterIP"] for name in ("svc-a", "svc-b", "svc-np")]
    node_ports = {p["name"]: p["nodePort"] for p in env.service("svc-np")["spec"]["ports"]}
    tcp = [f"{ip}:{TCP_PORT}" for ip in ips] + [f"{n.ipv4}:{node_ports['tcp']}" for n in env.nodes]
    udp = [f"{ip}:{UDP_PORT}" for ip in ips] + [f"{n.ipv4}:{node_ports['udp']}" for n in env.nodes]
    return tcp, udp, f"{ips[0]}:{HOLD_PORT}"


@dataclass
class LoadOptions:
    interval: float = 0.015  # a new TCP connection every 15 ms, per client
    udp_interval: float = 0.02  # a UDP exchange every 20 ms, per client
    holds: int = 2  # held connections per client
    timeout: float = 3.0
    warmup: float = 2.0  # load before the patch
    settle: float = 3.0  # load after the rollout finished


def _start_load(env: MigrationEnv, opts: LoadOptions) -> list[tuple[subprocess.Popen[Any], Path]]:
    tcp, udp, hold = _targets(env)
    argv_common: list[str] = []
    for target in tcp:
        argv_common += ["--tcp", target]
    for target in udp:
        argv_common += ["--udp", target]
    argv_common += ["--hold", hold, "--holds", str(opts.holds)]
    argv_common += ["--interval", str(opts.interval), "--udp-interval", str(opts.udp_interval)]
    argv_common += ["--timeout", str(opts.timeout)]
    started = []
    for client in env.clients:
        out = env.topo.tmpdir / f"{client.name}-{secrets.token_hex(3)}.json"
        argv = [
            sys.executable,
            "-m",
            "kpx_cluster.migration_load",
            "client",
            *argv_common,
            "--out",
            str(out),
        ]
        proc = env.topo.run_ready(client, argv, timeout=30, stdin=subprocess.PIPE)
        started.append((proc, out))
    return started


def _stop_load(
    started: Sequence[tuple[subprocess.Popen[Any], Path]], timeout: float
) -> list[Summary]:
    for proc, _ in started:
        assert proc.stdin is not None
        proc.stdin.close()
    summaries = []
    for proc, out in started:
        proc.wait(timeout=timeout + 15)
        summaries.append(Summary.from_json(out.read_text()))
    return summaries


def preflight_load(env: MigrationEnv, seconds: float = 2.0) -> list[Summary]:
    """A short run of the load before any switch: every target must answer (a broken setup
    must not pass for a broken migration)."""
    started = _start_load(env, LoadOptions(holds=1))
    time.sleep(seconds)
    return _stop_load(started, 3.0)


def switch(
    env: MigrationEnv,
    old: str,
    new: str,
    opts: LoadOptions | None = None,
    timeout: float = 300,
    log: Callable[[str], None] = print,
) -> SwitchResult:
    opts = opts or LoadOptions()
    assert env.rolled_out(old), f"not serving in {old} on every node before the switch"
    return explained(env, log, lambda: _switch(env, old, new, opts, timeout, log))


def _switch(
    env: MigrationEnv,
    old: str,
    new: str,
    opts: LoadOptions,
    timeout: float,
    log: Callable[[str], None],
) -> SwitchResult:
    started = _start_load(env, opts)
    node_ready: dict[str, float] = {}
    try:
        time.sleep(opts.warmup)
        t0 = time.monotonic()
        log(f"patching spec.mode {old} -> {new}")
        env.patch_mode(old, new)

        def done() -> bool:
            for pod in env.agent_pods():
                node = pod["spec"]["nodeName"]
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in pod.get("status", {}).get("conditions", [])
                )
                if ready and agent_mode(pod) == new and node not in node_ready:
                    node_ready[node] = round(time.monotonic() - t0, 1)
                    log(f"  {node}: agent in {new} Ready after {node_ready[node]}s")
            return env.rolled_out(new) and not env.leftovers(old)

        wait_until(done, timeout, f"{new} on every node and no {old} rules left")
        duration = time.monotonic() - t0
        log(f"rolled out in {duration:.1f}s")
        time.sleep(opts.settle)
    finally:
        loads = _stop_load(started, opts.timeout)
    return SwitchResult(
        old, new, len(env.nodes), round(duration, 1), loads, env.leftovers(old), node_ready
    )


def explained(
    env: MigrationEnv, log: Callable[[str], None], run: Callable[[], SwitchResult]
) -> SwitchResult:
    """`run` (a migration under load) with every node's events recorded; when tries failed,
    what explains them is logged (`diagnose`)."""
    with node_events.recording(env.topo, env.nodes) as events:
        result = run()
    for line in diagnose(env, result.loads, events):
        log(line)
    return result


def diagnose(
    env: MigrationEnv, loads: Sequence[Summary], events: node_events.NodeEvents
) -> list[str]:
    """When a load's new connections or UDP exchanges failed: what every node did around the
    first failures (`node_events.explain`) and the agents' log lines from 10 s before the first
    to 5 s after the last. Empty when none failed."""
    failures = [
        (s.started_at + at, target, reason)
        for s in loads
        for tries in (s.tcp, s.udp)
        for at, target, reason in tries.failures
    ]
    if not failures:
        return []
    out = ["what the nodes did around the failed tries (wall clock, UTC):"]
    out += node_events.explain(events.snapshot(), failures)
    first = min(at for at, _, _ in failures) - 10.0
    last = max(at for at, _, _ in failures) + 5.0
    for pod in env.agent_pods():
        name = pod["metadata"]["name"]
        got = env.cluster.kubectl("-n", NS, "logs", name, "--timestamps", check=False)
        if got.returncode != 0:
            out.append(f"-- agent {name}: no logs: {got.stderr.strip()[:300]}")
            continue
        kept = [line for line in got.stdout.splitlines() if first <= _log_time(line) <= last]
        out.append(f"-- agent {name} on {pod['spec'].get('nodeName')}: {len(kept)} log lines")
        out += [f"   {line[:300]}" for line in kept[-80:]]
    return out


def _log_time(line: str) -> float:
    """The wall clock of a `kubectl logs --timestamps` line (RFC 3339, nanoseconds); 0 when
    the line has none."""
    stamp = line.split(" ", 1)[0]
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        whole = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC)
    except ValueError:
        return 0.0
    return whole.timestamp() + (float(f"0.{frac}") if frac.isdigit() else 0.0)


TABLE_HEAD = (
    "| switch | nodes | rollout (s) | load (s) | new TCP connections tried / failed (slow >0.9 s) "
    "| UDP exchanges / lost (slow) | held connections survived | old-mode leftovers |\n"
    "|---|---|---|---|---|---|---|---|"
)


def table_row(r: SwitchResult) -> str:
    left = sum(len(v) for v in r.leftovers.values())
    return (
        f"| {r.switch} | {r.nodes} | {r.duration:.1f} | {r.load_seconds:.1f} "
        f"| {r.total('tcp', 'tried')} / {r.total('tcp', 'failed')} ({r.total('tcp', 'slow')}) "
        f"| {r.total('udp', 'tried')} / {r.total('udp', 'failed')} ({r.total('udp', 'slow')}) "
        f"| {r.held_survived} of {r.held} | {left if left else 'none'} |"
    )


# ---- an injected failure: one node's new agent cannot program nftables ------------------------


@contextlib.contextmanager
def nft_refused(env: MigrationEnv, node: Node) -> Iterator[None]:
    """While inside, nobody but this process may change the nftables table `ip kpx` in `node`'s
    netns: `nft -i` creates it with `flags owner` (the kernel refuses every other netlink socket
    a change to an owned table, EPERM) and keeps its socket open until its stdin closes, which
    removes the table. An nftables agent there can then program nothing."""
    proc = env.topo.run(
        node,
        ["nft", "-i"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(b"add table ip kpx { flags owner ; }\n")
        proc.stdin.flush()
        wait_until(lambda: mode_rules(env.topo, node, "nftables"), 10, "the owned kpx table")
        probe = env.topo.exec(node, ["nft", "add", "chain", "ip", "kpx", "probe"])
        assert probe.returncode != 0, "an owned table accepted another socket's change"
        yield
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


@dataclass
class RefusalResult:
    """A switch with one node whose new agent cannot program the kernel (`nft_refused`)."""

    old: str
    new: str
    refused_node: str
    #: how long the refusal was held after the patch (s)
    held_for: float
    #: node -> "mode ready|not ready" of its agent at the end of the refusal
    agents: dict[str, str]
    #: the ProxyConfiguration's Ready condition and status summary then
    ready_condition: dict[str, Any]
    status: dict[str, Any]
    #: whether the refused node still had the old mode's rules then
    old_rules_kept: bool
    #: from lifting the refusal to the rollout done (None: not done within the timeout)
    after_lift: float | None
    loads: list[Summary]
    #: (seconds after the patch, the agents' states, the ProxyConfiguration's Ready status)
    #: at each change while the refusal was held
    timeline: list[tuple[float, dict[str, str], str]] = field(default_factory=list)
    #: status.modeSwitch and condition ModeSwitch at the end of the refusal, and status.modeSwitch
    #: once it finished after the lift (or as it was when the wait for it timed out)
    mode_switch: dict[str, Any] = field(default_factory=dict)
    mode_switch_condition: dict[str, Any] = field(default_factory=dict)
    mode_switch_after: dict[str, Any] = field(default_factory=dict)

    def traffic_failures(self) -> list[str]:
        probe = SwitchResult(self.old, self.new, 0, 0.0, self.loads, {})
        return probe.failures()


def _agent_states(env: MigrationEnv) -> dict[str, str]:
    out = {}
    for pod in env.agent_pods():
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod.get("status", {}).get("conditions", [])
        )
        gone = " terminating" if pod["metadata"].get("deletionTimestamp") else ""
        out[pod["spec"]["nodeName"]] = (
            f"{agent_mode(pod)} {'ready' if ready else 'not ready'}{gone}"
        )
    return dict(sorted(out.items()))


def _ready_status(env: MigrationEnv) -> str:
    conditions = env.json("get", "pxc", env.pxc).get("status", {}).get("conditions", [])
    ready: dict[str, Any] = next((c for c in conditions if c["type"] == "Ready"), {})
    return f"{ready.get('status')} ({ready.get('reason')})"


def switch_with_refusal(
    env: MigrationEnv,
    old: str,
    new: str,
    node: Node,
    hold_for: float = 60.0,
    opts: LoadOptions | None = None,
    timeout: float = 300,
    log: Callable[[str], None] = print,
) -> RefusalResult:
    """Under load: refuse nftables on `node`, patch spec.mode, watch for `hold_for` s what the
    rollout and the traffic do, lift the refusal and wait for the rollout to finish. Without
    rollback (spec.modeSwitch.rollbackOnFailure false for the run: the node is Stuck and its
    agent retries; `kpx_cluster.migration_rollback` runs the same with the rollback)."""
    assert new == "nftables", "the injection refuses nftables"
    opts = opts or LoadOptions()
    assert env.rolled_out(old), f"not serving in {old} on every node before the switch"
    env.patch_mode_switch(rollbackOnFailure=False)
    started = _start_load(env, opts)
    after_lift: float | None = None
    try:
        time.sleep(opts.warmup)
        with nft_refused(env, node):
            log(f"nftables refused on {node.name}; patching spec.mode {old} -> {new}")
            t0 = time.monotonic()
            env.patch_mode(old, new)
            timeline: list[tuple[float, dict[str, str], str]] = []
            while time.monotonic() - t0 < hold_for:
                states, ready_now = _agent_states(env), _ready_status(env)
                if not timeline or (states, ready_now) != timeline[-1][1:]:
                    at = round(time.monotonic() - t0, 1)
                    log(f"  +{at}s agents: {states}; Ready={ready_now}")
                    timeline.append((at, states, ready_now))
                time.sleep(1)
            pxc = env.json("get", "pxc", env.pxc)
            status = pxc.get("status", {})
            ready: dict[str, Any] = next(
                (c for c in status.get("conditions", []) if c["type"] == "Ready"), {}
            )
            switch_then = dict(status.get("modeSwitch") or {})
            switch_cond: dict[str, Any] = next(
                (c for c in status.get("conditions", []) if c["type"] == "ModeSwitch"), {}
            )
            log(
                f"status.modeSwitch: {switch_then.get('summary')}; ModeSwitch condition "
                f"{switch_cond.get('reason')}: {switch_cond.get('message')}"
            )
            agents = _agent_states(env)
            kept = bool(mode_rules(env.topo, node, old))
            log(
                f"after {hold_for:.0f}s: agents {agents}; Ready condition {ready}; "
                f"{old} rules on {node.name}: {'kept' if kept else 'gone'}"
            )
        t_lift = time.monotonic()
        log(f"refusal lifted on {node.name}")
        after_lift = wait_rolled_out(
            env, old, new, t_lift, "after the refusal was lifted", timeout, log
        )
        switch_after = mode_switch_finished(env, 60, log)
        time.sleep(opts.settle)
    finally:
        loads = _stop_load(started, opts.timeout)
        env.patch_mode_switch(rollbackOnFailure=None)
    summary = {k: status.get(k) for k in ("mode", "readyNodes", "desiredNodes") if k in status}
    return RefusalResult(
        old,
        new,
        node.name,
        hold_for,
        agents,
        ready,
        summary,
        kept,
        after_lift,
        loads,
        timeline,
        switch_then,
        switch_cond,
        switch_after,
    )


def wait_rolled_out(
    env: MigrationEnv,
    old: str,
    new: str,
    since: float,
    what: str,
    timeout: float,
    log: Callable[[str], None] = print,
) -> float | None:
    """Wait until every node runs a Ready agent of `new` and none has `old`'s rules; the
    seconds since `since` (time.monotonic()), or None (logged) when it did not happen."""
    try:
        wait_until(
            lambda: env.rolled_out(new) and not env.leftovers(old),
            timeout,
            f"{new} on every node {what}",
        )
    except TimeoutError as err:
        log(str(err))
        return None
    took = round(time.monotonic() - since, 1)
    log(f"rolled out {took}s {what}")
    return took


def mode_switch_finished(
    env: MigrationEnv, timeout: float, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """status.modeSwitch once it says finished (the last node's LeftoversRemoved may come a
    pass after the rollout is Ready), or as it is when `timeout` s passed."""

    def finished() -> dict[str, Any] | None:
        got = dict(env.json("get", "pxc", env.pxc).get("status", {}).get("modeSwitch") or {})
        return got if got.get("finishedAt") else None

    try:
        got = wait_until(finished, timeout, "status.modeSwitch finished")
    except TimeoutError as err:
        log(str(err))
        return dict(env.json("get", "pxc", env.pxc).get("status", {}).get("modeSwitch") or {})
    log(f"status.modeSwitch: {got.get('summary')}")
    return got
