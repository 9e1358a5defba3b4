"""The whole product on a 3-node simulated cluster, installed as a user would.

The CRD and the operator's shipped manifests are applied (the operator runs as its Deployment
on the simulated nodes, with its shipped RBAC), then examples/proxyconfig.yaml. The agents'
DaemonSet runs real agents in the node network namespaces; a Deployment of backends and a
Service give real traffic from a client pod.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agent_harness import wait_until as harness_wait_until

from kpx_cluster import demo
from kpx_cluster.controlplane import Cluster
from kpx_cluster.kubeconfig import write_kubeconfig
from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.nodesim import NodeSimulator
from kpx_cluster.nodesim.runc import built_images
from kpx_cluster.probe import ProbeResult, probe

pytestmark = [pytest.mark.e2e, pytest.mark.netns]
REPO = Path(__file__).resolve().parents[2]
NS = "kpx-system"
APP_NS = "e2e-cluster-app"
T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float, what: str | Callable[[], str]) -> T:
    return harness_wait_until(check, timeout, interval=0.5, message=what)  # type: ignore[arg-type]


@dataclass
class Env:
    cluster: Cluster
    topo: Topology
    sim: NodeSimulator
    nodes: list[Node]
    client: Pod
    label: dict[str, str]

    def json(self, *args: str) -> dict[str, Any]:
        out = self.cluster.kubectl(*args, "-o", "json", check=False)
        return dict(json.loads(out.stdout)) if out.returncode == 0 else {}

    def pxc(self) -> dict[str, Any]:
        return self.json("get", "pxc", "default")

    def condition(self, kind: str) -> dict[str, Any]:
        for cond in self.pxc().get("status", {}).get("conditions", []):
            if cond["type"] == kind:
                return dict(cond)
        return {}

    def agents(self) -> dict[str, tuple[str, int]]:
        """node -> (pod uid, restart count) of the agent pods."""
        pods = self.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")
        return {
            p["spec"]["nodeName"]: (
                p["metadata"]["uid"],
                sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", [])),
            )
            for p in pods.get("items", [])
            # not being deleted, and bound (a Pod the DaemonSet just made has no node yet)
            if not p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName")
        }

    def describe(self) -> str:
        """For a failure's message: the resource's status, and each agent pod's node, phase,
        containers ready and restarts."""
        pods = self.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")
        states = {
            p["metadata"]["name"]: (
                p["spec"].get("nodeName"),
                p["status"].get("phase"),
                [c.get("ready") for c in p["status"].get("containerStatuses", [])],
                sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", [])),
            )
            for p in pods.get("items", [])
        }
        return f"status: {json.dumps(self.pxc().get('status'))}; agent pods: {states}"

    def vip(self) -> str:
        return str(self.json("-n", APP_NS, "get", "svc", "web")["spec"]["clusterIP"])

    def probe(self, count: int = 12) -> ProbeResult:
        return probe(self.topo, self.client, self.vip(), 80, "tcp", count=count, timeout=1)

    def patch_pxc(self, patch: dict[str, Any]) -> None:
        self.cluster.kubectl("patch", "pxc", "default", "--type=merge", "-p", json.dumps(patch))

    def ready(self, mode: str) -> dict[str, Any] | None:
        pxc = self.pxc()
        st = pxc.get("status", {})
        ok = (
            self.condition("Ready").get("status") == "True"
            and st.get("observedGeneration") == pxc["metadata"]["generation"]
            and st.get("mode") == mode
            and st.get("readyNodes") == 3
        )
        return st if ok else None


def _apply(cluster: Cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[Env]:
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-cluster": run}
    with Topology() as topo:
        try:
            store = built_images()
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        # The operator and the agents run from their images under runc; the test's own
        # backends ("echo") run as host processes.
        sim = NodeSimulator(cluster, topo, pod_apiserver_access=True, runtime="runc", images=store)
        try:
            nodes = [sim.add_node(f"c{run}-{i}", labels=label) for i in (1, 2, 3)]

            cluster.wait_namespace_settled(NS)  # an earlier module may have deleted it
            cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
            cluster.kubectl(
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/proxyconfigurations.proxy.kpx.dev",
            )
            cluster.kubectl("apply", "-k", str(REPO / "operator" / "manifests"))
            # Keep the operator's replicas on this test's nodes (other tests add Node objects).
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
            example = demo.proxy_configuration()  # examples/proxyconfig.yaml, as `make demo`
            example["spec"]["nodeSelector"] = label
            _apply(cluster, example)
            _start_app(cluster, label)
            client = topo.add_pod(nodes[0], "client")
            yield Env(cluster, topo, sim, nodes, client, label)
        finally:
            for args in (
                ("delete", "pxc", "default", "--ignore-not-found", "--timeout=120s"),
                ("delete", "namespace", APP_NS, "--ignore-not-found", "--wait=false"),
                ("-n", NS, "delete", "deploy", "kpx-operator", "--ignore-not-found"),
                # The manifests' cluster-scoped objects (the operator's and the agents' roles and
                # bindings) too: a later `helm install` of the chart must find none it does not own.
                (
                    "delete",
                    "-k",
                    str(REPO / "operator" / "manifests"),
                    "--ignore-not-found",
                    "--wait=false",
                ),
            ):
                cluster.kubectl(*args, check=False, timeout=150)
            sim.stop(delete_nodes=True)


def _start_app(cluster: Cluster, label: dict[str, str]) -> None:
    cluster.create_namespace(APP_NS)
    _apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": APP_NS},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "nodeSelector": label,
                        "automountServiceAccountToken": False,
                        "containers": [
                            {
                                "name": "web",
                                "image": "echo",
                                "command": [
                                    "python3",
                                    "-m",
                                    "kpx_cluster.echo_server",
                                    "--name",
                                    "$(POD_NAME)",
                                    "--port",
                                    "8080",
                                    "--tcp",
                                ],
                                "env": [
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    }
                                ],
                                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                            }
                        ],
                    },
                },
            },
        },
    )
    _apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": APP_NS},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )


def kpx_rules(env: Env, node: Node) -> dict[str, bool]:
    tables = env.topo.exec(node, ["nft", "list", "tables"], check=True).stdout
    chains = env.topo.exec(node, ["iptables-save", "-t", "nat"], check=True).stdout
    return {"nftables": " kpx" in tables, "iptables": ":KPX-" in chains}


def test_ready_and_traffic_flows(env: Env) -> None:
    status = wait_until(lambda: env.ready("nftables"), 120, "default Ready on 3 nodes")
    assert status["desiredNodes"] == 3
    wait_until(
        lambda: (
            env.json("-n", APP_NS, "get", "deploy", "web").get("status", {}).get("readyReplicas")
            == 3
        ),
        90,
        "app ready",
    )
    result = wait_until(
        lambda: (r := env.probe()).failed == 0 and len(r.backends) >= 2 and r,
        30,
        "traffic through the ClusterIP",
    )
    assert all(name.startswith("web-") for name in result.backends)
    for node in env.nodes:
        assert kpx_rules(env, node) == {"nftables": True, "iptables": False}


def test_a_fresh_install_reads_healthy_in_every_condition(env: Env) -> None:
    """`make demo`'s ProxyConfiguration (examples/proxyconfig.yaml with kind's maxPerCore 0)
    on nodes that are network namespaces of this machine, as kind's nodes are containers: a
    new user's first `kubectl get pxc -o yaml` reads healthy in every condition, the agents
    applied spec.conntrack's timeouts on each node (their own network namespace) and left the
    machine's alone."""
    wait_until(lambda: env.ready("nftables"), 120, "default Ready on 3 nodes")
    time.sleep(3)  # the agents' conntrack reports (Events) and the operator's next status
    pxc = env.pxc()
    assert demo.unhealthy_conditions(pxc) == {}
    assert {c["type"] for c in pxc["status"]["conditions"]} >= {"Ready", "Degraded"}
    events = env.json("-n", NS, "get", "events", "--field-selector", "reason=ConntrackNotApplied")
    assert [e["message"] for e in events.get("items", [])] == []
    established = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"
    for node in env.nodes:  # spec.conntrack.tcpEstablishedTimeout: 24h (the default)
        assert env.topo.exec(node, ["cat", established], check=True).stdout.strip() == "86400"
    # the test process is in the machine's namespace: not what the agents set there
    assert Path(established).read_text().strip() != "86400"


def test_each_agent_writes_its_own_node_state(env: Env) -> None:
    """Each node's agent (its kubelet-mounted token bound to its Pod, the shipped admission
    policy in force) writes the ProxyNodeState of its node: mode, the generation synced, what
    it programmed; `kubectl get proxynodestates` shows it."""
    wait_until(lambda: env.ready("nftables"), 120, "default Ready")
    generation = env.pxc()["metadata"]["generation"]
    pods = env.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")["items"]
    uid_of = {
        p["spec"]["nodeName"]: p["metadata"]["uid"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }

    def states() -> dict[str, dict[str, Any]] | None:
        items = env.json("get", "proxynodestates").get("items") or []
        got = {i["metadata"]["name"]: i.get("status") or {} for i in items}
        ok = all(
            (got.get(n.name) or {}).get("configurationGeneration") == generation
            and (got.get(n.name) or {}).get("firstSyncVerified")
            # The other modes' rules go right after the first verified sync: the state says
            # so at most one write period (10 s) later.
            and (got.get(n.name) or {}).get("leftoversPending") == []
            for n in env.nodes
        )
        return got if ok else None

    got = wait_until(states, 60, "every node's ProxyNodeState at the current generation")
    for node in env.nodes:
        status = got[node.name]
        assert status["mode"] == "nftables" and status["agentPod"]["uid"] == uid_of[node.name]
        assert status["programmed"]["services"] > 0 and status["programmed"]["rules"] > 0
    table = env.cluster.kubectl("get", "proxynodestates").stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "MODE", "GENERATION", "AGENT", "VERIFIED"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    for node in env.nodes:
        assert rows[node.name][1:5] == ["nftables", str(generation), "0.1.0", "true"]


def test_opt_out_change_is_live_without_agent_restarts(env: Env) -> None:
    wait_until(lambda: env.ready("nftables"), 120, "default Ready")
    before = env.agents()
    env.patch_pxc({"spec": {"namespaceOptOut": {"namespaces": ["legacy-proxy", APP_NS]}}})
    wait_until(lambda: not env.probe(4).backends, 40, "the opted-out Service stops working")
    env.patch_pxc({"spec": {"namespaceOptOut": {"namespaces": ["legacy-proxy"]}}})
    wait_until(lambda: env.probe(4).failed == 0, 40, "the Service works again")
    assert env.agents() == before, "agents were restarted for a live setting"


def _agent_pods(env: Env) -> list[dict[str, Any]]:
    pods = env.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")
    return [p for p in pods.get("items", []) if not p["metadata"].get("deletionTimestamp")]


def _reloads(env: Env) -> dict[str, int]:
    """pod name -> how often its agent logged a configuration reload."""
    out = {}
    for p in _agent_pods(env):
        sim_pod = env.sim.pod(NS, p["metadata"]["name"])
        log = sim_pod.logs.get("agent") if sim_pod else None
        text = log.read_text(errors="replace") if log and log.exists() else ""
        out[p["metadata"]["name"]] = text.count("configuration reloaded")
    return out


def _unready_agents(env: Env) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in _agent_pods(env)
        if not any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]


def test_idle_agents_stay_ready_and_are_not_restarted_by_their_probes(env: Env) -> None:
    """syncPeriod 5s (a live setting; health timeout 2 x 5s): with nothing to program for
    45 s (9 syncPeriods), every agent pod stays Ready (readiness probe: /healthz) and is never
    restarted (liveness probe: /alivez), as upstream kube-proxy in a quiet cluster. Idle agents
    used to report unhealthy 2 x syncPeriod after their last sync (10 s here); the readiness
    probe sees that within 10 s more and the liveness probe restarts within 30 s more (period
    10 s x 3 failures), so 45 s covers both."""
    wait_until(lambda: env.ready("nftables"), 120, "default Ready")
    reloads = _reloads(env)
    assert len(reloads) == 3, reloads
    env.patch_pxc({"spec": {"nftables": {"syncPeriod": "5s"}}})
    try:
        wait_until(
            lambda: all(n > reloads.get(pod, 0) for pod, n in _reloads(env).items()),
            60,
            "every agent reloaded its configuration (syncPeriod 5s)",
        )
        before = env.agents()
        idle_until = time.monotonic() + 45
        while time.monotonic() < idle_until:
            assert not _unready_agents(env), "an idle agent turned unready"
            time.sleep(4)
        assert env.agents() == before, "idle agents were restarted by their liveness probe"
    finally:
        env.patch_pxc({"spec": {"nftables": {"syncPeriod": "30s"}}})


def _runc_process(pod: dict[str, Any]) -> dict[str, str]:
    """/proc/PID/status of the (first) container of `pod`, which the simulator runs under runc:
    what the kernel says about the running process, not what its spec asked for."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("runc://"), container_id
    state = subprocess.run(
        ["runc", "state", container_id.removeprefix("runc://")],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = json.loads(state.stdout)["pid"]
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    status = {k: v.strip() for k, v in status.items()}
    root = next(
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    status["root mount options"] = root[5]
    return status


#: CAP_NET_ADMIN is bit 12 of the kernel's capability masks.
NET_ADMIN_MASK = f"{1 << 12:016x}"


def test_operator_runs_non_root_on_a_read_only_root(env: Env) -> None:
    """The operator's pod, run from its image by the simulated kubelet: uid/gid 65532, no
    capabilities, no privilege escalation, and its root filesystem mounted read-only."""
    pods = env.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-operator")
    running = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    assert running, "no operator pod"
    proc = _runc_process(running[0])
    assert proc["Uid"].split() == ["65532"] * 4, proc["Uid"]
    assert proc["Gid"].split() == ["65532"] * 4, proc["Gid"]
    assert int(proc["CapEff"], 16) == 0 and int(proc["CapBnd"], 16) == 0
    assert proc["NoNewPrivs"] == "1"
    assert proc["Seccomp"] == "2"  # a filter: RuntimeDefault
    assert "ro" in proc["root mount options"].split(","), proc["root mount options"]


def test_agents_run_with_only_their_declared_capabilities(env: Env) -> None:
    pods = env.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")
    agents = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    assert len(agents) == 3
    for pod in agents:
        proc = _runc_process(pod)
        assert proc["CapEff"] == NET_ADMIN_MASK, (pod["metadata"]["name"], proc["CapEff"])
        assert proc["CapBnd"] == NET_ADMIN_MASK
        assert proc["Uid"].split()[0] == "0"  # root in the container, but only NET_ADMIN


def test_the_agent_daemonset_without_net_admin_programs_nothing(env: Env) -> None:
    """The operator's own agent DaemonSet, copied with NET_ADMIN removed and aimed at a fourth
    node: its agent cannot program the node's kernel, says why, and never turns Ready."""
    run = env.label["kpx.dev/e2e-cluster"]
    label = {"kpx.dev/e2e-no-net-admin": run}
    node = env.sim.add_node(f"c{run}-nocap", labels=label)
    listing = env.json("-n", NS, "get", "ds", "-l", "app.kubernetes.io/name=kpx-agent")
    original = listing["items"][0]
    spec = json.loads(json.dumps(original["spec"]))
    own = {"app.kubernetes.io/name": "kpx-agent-no-net-admin"}
    spec["selector"] = {"matchLabels": own}
    template = spec["template"]
    template["metadata"]["labels"] = own
    template["spec"]["nodeSelector"] = label
    removed = 0
    for container in [*template["spec"].get("initContainers", []), *template["spec"]["containers"]]:
        caps = container.get("securityContext", {}).get("capabilities", {})
        removed += caps.get("add", []).count("NET_ADMIN")
        caps["add"] = [c for c in caps.get("add", []) if c != "NET_ADMIN"]
    assert removed, "the operator's DaemonSet declares no NET_ADMIN"
    _apply(
        env.cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "kpx-agent-no-net-admin", "namespace": NS},
            "spec": spec,
        },
    )
    try:

        def started() -> dict[str, Any] | None:
            pods = env.json(
                "-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent-no-net-admin"
            )
            for pod in pods.get("items", []):
                for cs in pod["status"].get("containerStatuses", []):
                    if "running" in cs["state"] or cs["restartCount"]:
                        return pod
            return None

        pod = wait_until(started, 90, "the agent without NET_ADMIN started")
        name = pod["metadata"]["name"]

        def told() -> str | None:
            sim_pod = env.sim.pod(NS, name)
            logs = sim_pod.logs.values() if sim_pod is not None else []
            text = "".join(p.read_text() for p in logs if p.exists())
            return text if "Operation not permitted" in text else None

        wait_until(told, 60, "the agent reporting it may not program the kernel")
        pod = env.json("-n", NS, "get", "pod", name)
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"]
        assert ready == "False", "an agent that programmed nothing reports Ready"
        tables = env.topo.exec(node, ["nft", "list", "tables"], check=True).stdout
        assert "kpx" not in tables, tables
        assert int(_runc_process(pod)["CapEff"], 16) & (1 << 12) == 0
    finally:
        env.cluster.kubectl(
            "-n",
            NS,
            "delete",
            "ds",
            "kpx-agent-no-net-admin",
            "--ignore-not-found",
            "--timeout=60s",
            check=False,
        )


def test_agent_token_is_least_privilege(env: Env, tmp_path: Path) -> None:
    token = env.cluster.kubectl("-n", NS, "create", "token", "kpx-agent").stdout.strip()
    (tmp_path / "token").write_text(token)
    kubeconfig = write_kubeconfig(
        tmp_path / "agent.kubeconfig",
        server=env.cluster.server,
        ca=env.cluster.ca_file,
        user="kpx-agent",
        token_file=tmp_path / "token",
    )

    def kubectl(*args: str) -> tuple[int, str]:
        out = env.cluster.kubectl(*args, kubeconfig=kubeconfig, check=False)
        return out.returncode, out.stderr

    assert kubectl("get", "services", "-A")[0] == 0
    assert kubectl("get", "endpointslices", "-A")[0] == 0
    code, err = kubectl("get", "secrets", "-A")
    assert code != 0 and "forbidden" in err.lower()
    code, err = kubectl("-n", APP_NS, "create", "service", "clusterip", "evil", "--tcp=1:1")
    assert code != 0 and "forbidden" in err.lower()
    code, err = kubectl("-n", APP_NS, "delete", "service", "web")
    assert code != 0 and "forbidden" in err.lower()


def test_mode_switch_moves_the_rules(env: Env) -> None:
    wait_until(lambda: env.ready("nftables"), 120, "default Ready")
    env.patch_pxc({"spec": {"mode": "iptables", "nftables": None}})
    wait_until(
        lambda: env.ready("iptables"),
        180,
        lambda: f"iptables agents Ready on 3 nodes ({env.describe()})",
    )
    assert "'Running'" in env.describe()  # the failure message above can be made
    for node in env.nodes:
        rules = wait_until(lambda n=node: (r := kpx_rules(env, n))["iptables"] and r, 30, "rules")
        assert rules == {"nftables": False, "iptables": True}, node.name
    wait_until(lambda: env.probe().failed == 0, 30, "traffic in iptables mode")


def test_mode_external_runs_the_backend_next_to_a_state_server_only_agent(env: Env) -> None:
    """Mode external: the agents drop their kernel rules and serve the state API; the JSON
    plugin (examples/plugins), deployed by the operator from spec.external as a sidecar
    sharing the socket's directory, writes each node's state, with the app's Service."""
    plugin = REPO / "examples" / "plugins" / "json-file" / "json_file_plugin.py"
    out = env.topo.tmpdir / "external-state"
    out.mkdir(exist_ok=True)
    backend = {
        "image": "python",  # a harness image: the node simulator runs it as a host process
        "command": ["python3", str(plugin)],
        "args": ["--output", f"{out}/$(NODE_NAME).json"],
    }
    env.patch_pxc(
        {"spec": {"mode": "external", "iptables": None, "nftables": None, "external": backend}}
    )

    wait_until(
        lambda: env.ready("external"),
        180,
        lambda: f"external agents Ready on 3 nodes ({env.describe()})",
    )
    for node in env.nodes:
        wait_until(lambda n=node: not any(kpx_rules(env, n).values()), 30, "no kernel rules")

        def web(n: Node = node) -> list[Any]:
            path = out / f"{n.name}.json"
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                return []
            return [
                p
                for p in data["servicePorts"]
                if (p["key"]["namespace"], p["key"]["name"]) == (APP_NS, "web")
            ]

        (port,) = wait_until(web, 60, f"{node.name}: the web Service in the plugin's file")
        assert len(port["cluster_endpoints"]) == 3, port
        eps = port["cluster_endpoints"]
        assert [(e["ready"], e["serving"], e["terminating"]) for e in eps] == [(1, 1, 0)] * 3
        facts = json.loads((out / f"{node.name}.json").read_text())["nodeFacts"]
        assert [f["family"] for f in facts] == [4, 6]
    pods = env.json("-n", NS, "get", "pods", "-l", "app.kubernetes.io/name=kpx-agent")
    for pod in pods["items"]:
        assert [c["name"] for c in pod["spec"]["containers"]] == ["agent", "backend"]


def test_deleted_daemonset_returns(env: Env) -> None:
    mode = str(env.pxc()["spec"]["mode"])
    env.cluster.kubectl("-n", NS, "delete", "daemonset", "kpx-agent-default")
    wait_until(lambda: env.json("-n", NS, "get", "ds", "kpx-agent-default"), 60, "DaemonSet back")
    wait_until(lambda: env.ready(mode), 120, "agents Ready again")


def test_an_orphaning_delete_keeps_the_agents_and_service_traffic(env: Env) -> None:
    """Issue #22: deleting used to stop every agent and flush every node's rules within
    seconds. With spec.deletionPolicy Orphan (the default), deleted as Argo CD prunes
    (foreground propagation), the agents keep running and serving, their rules stay; a
    re-created ProxyConfiguration of the same name adopts them without restarting them."""
    if env.pxc()["spec"]["mode"] not in ("nftables", "iptables"):  # rules in the kernel
        env.patch_pxc({"spec": {"mode": "nftables", "external": None}})
    spec = env.pxc()["spec"]
    mode = str(spec["mode"])
    wait_until(lambda: env.ready(mode), 180, f"{mode} agents Ready")
    wait_until(lambda: env.probe().failed == 0, 30, "traffic before the deletion")
    before_agents, before_rules = env.agents(), {n.name: kpx_rules(env, n) for n in env.nodes}
    assert len(before_agents) == 3 and all(any(r.values()) for r in before_rules.values())
    env.cluster.kubectl(
        "delete", "pxc", "default", "--cascade=foreground", "--timeout=60s", timeout=90
    )
    assert env.json("get", "pxc", "default") == {}
    assert env.json("-n", NS, "get", "ds", "kpx-agent-default")  # not garbage-collected
    assert env.agents() == before_agents  # the same Pods, not restarted
    assert {n.name: kpx_rules(env, n) for n in env.nodes} == before_rules
    result = env.probe()
    assert result.failed == 0 and result.backends, result
    # Adopted: the same name, now with Cleanup for the test that follows.
    _apply(
        env.cluster,
        {
            "apiVersion": "proxy.kpx.dev/v1alpha1",
            "kind": "ProxyConfiguration",
            "metadata": {"name": "default"},
            "spec": {**spec, "deletionPolicy": "Cleanup"},
        },
    )
    wait_until(lambda: env.ready(mode), 120, "the re-created configuration Ready")
    assert env.agents() == before_agents


def test_delete_leaves_no_rules_on_any_node(env: Env) -> None:
    if env.pxc()["spec"].get("deletionPolicy") != "Cleanup":  # this test run alone
        env.patch_pxc({"spec": {"deletionPolicy": "Cleanup"}})
    env.cluster.kubectl("delete", "pxc", "default", "--timeout=150s", timeout=180)
    for node in env.nodes:
        assert kpx_rules(env, node) == {"nftables": False, "iptables": False}, node.name
    assert env.sim.refused == []
