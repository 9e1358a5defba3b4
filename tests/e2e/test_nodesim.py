"""The node simulator runs real workloads: controllers' Pods become processes, Ready, Endpoints.

Every test builds its own simulated nodes (labelled with a per-test run id that the workloads
select, so pods never land on nodes of other tests) on the session's real control plane, and
tears everything down: namespaces, pods (finalized by the simulated kubelets), Nodes, processes.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Topology
from kpx_cluster.nodesim import NodeSimulator, SimPod
from kpx_kube import NotFound, from_kubeconfig
from kpx_kube.blocking import BlockingClient

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

T = TypeVar("T")
Obj = dict[str, Any]
RUN_LABEL = "nodesim.kpx.test/run"
HTTP_BACKEND = ["python3", "-m", "kpx_cluster.http_backend"]


def wait_until(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2
) -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Api:
    """Admin reads through kpx_kube's client (cheaper than a kubectl run per poll); writes:
    kubectl."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.client = BlockingClient(from_kubeconfig(cluster.kubeconfig))

    def get(self, path: str, **params: str) -> Obj | None:
        try:
            return self.client.get(path, params)
        except NotFound:
            return None

    def items(self, path: str, **params: str) -> list[Obj]:
        listing = self.get(path, **params) or {}
        return list(listing.get("items") or [])

    def apply(self, *objs: Obj) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))


@dataclass
class SimEnv:
    """One test's simulator, its nodes and namespaces."""

    cluster: Cluster
    topology: Topology
    sim: NodeSimulator
    api: Api
    run: str = field(default_factory=lambda: secrets.token_hex(3))
    nodes: list[Node] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def add_nodes(self, count: int, **labels: str) -> list[Node]:
        for i in range(count):
            name = f"sim-{self.run}-{len(self.nodes) + 1}"
            zone = "zone-a" if i % 2 == 0 else "zone-b"
            all_labels = {RUN_LABEL: self.run, **labels}
            self.nodes.append(self.sim.add_node(name, labels=all_labels, zone=zone))
        return self.nodes

    def namespace(self) -> str:
        name = f"nodesim-{self.run}-{len(self.namespaces) + 1}"
        self.cluster.create_namespace(name)
        self.namespaces.append(name)
        return name

    def pods(self, ns: str, **selector: str) -> list[Obj]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
        return self.api.items(f"/api/v1/namespaces/{ns}/pods", **params)

    def pod(self, ns: str, name: str) -> Obj | None:
        return self.api.get(f"/api/v1/namespaces/{ns}/pods/{name}")

    def sim_pod(self, ns: str, name: str) -> SimPod:
        found = self.sim.pod(ns, name)
        assert found is not None, f"the simulator does not run {ns}/{name}"
        return found

    def log_of(self, ns: str, name: str, container: str | None = None) -> str:
        """The container's log ("" while the pod or container does not run yet)."""
        found = self.sim.pod(ns, name)
        logs = found.logs if found is not None else {}
        path = logs.get(container) if container else next(iter(logs.values()), None)
        return path.read_text() if path is not None and path.exists() else ""

    def pod_template(self, containers: list[Obj], **spec: Any) -> Obj:
        return {
            "nodeSelector": {RUN_LABEL: self.run},
            "terminationGracePeriodSeconds": 2,
            "containers": containers,
            **spec,
        }

    def bare_pod(self, ns: str, name: str, containers: list[Obj], **spec: Any) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"test": name}},
            "spec": self.pod_template(containers, **spec),
        }

    def pods_on_our_nodes(self) -> list[Obj]:
        found: list[Obj] = []
        for node in self.nodes:
            found += self.api.items("/api/v1/pods", fieldSelector=f"spec.nodeName={node.name}")
        return found

    def teardown(self) -> None:
        for ns in self.namespaces:
            # Workloads and pods first: the namespace controller alone takes ~5 s to get there.
            kinds = "daemonsets,deployments,replicasets,pods"
            self.cluster.kubectl("-n", ns, "delete", kinds, "--all", "--wait=false", check=False)
            self.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        # The simulated kubelets finalize the pods' deletion: wait for that before stopping.
        deadline = time.monotonic() + 30
        while self.pods_on_our_nodes() and time.monotonic() < deadline:
            time.sleep(0.3)
        left = [p["metadata"]["name"] for p in self.pods_on_our_nodes()]
        refused = self.sim.refused  # (transient refusals, overcome by a retry, are fine)
        self.sim.stop(delete_nodes=True)
        for node in self.nodes:
            assert self.api.get(f"/api/v1/nodes/{node.name}") is None, f"{node.name} not deleted"
        assert not left, f"pods not finalized by the simulated kubelets: {left}"
        assert not refused, f"the apiserver refused the simulated kubelets: {refused}"


@pytest.fixture
def env(cluster: Cluster, topology: Topology) -> Iterator[SimEnv]:
    sim = NodeSimulator(cluster, topology)
    simenv = SimEnv(cluster, topology, sim, Api(cluster))
    try:
        yield simenv
    finally:
        try:
            simenv.teardown()
        finally:
            simenv.api.client.close()


def http_backend(name: str, port: int, **extra: Any) -> Obj:
    return {
        "name": name,
        "image": "kpx/http-backend",
        "command": HTTP_BACKEND,
        "args": ["--name", "$(POD_NAME)", "--port", str(port)],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "ports": [{"name": "http", "containerPort": port}],
        **extra,
    }


def daemonset(env: SimEnv, ns: str, version: str = "1") -> Obj:
    container = {
        "name": "web",
        "image": "kpx/http-backend",
        "command": [*HTTP_BACKEND, "--name", "$(NODE_NAME)", "--port", "18080"],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "VERSION", "value": version},
        ],
        "readinessProbe": {"httpGet": {"path": "/x", "port": 18080}, "periodSeconds": 1},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": env.pod_template([container], hostNetwork=True),
            },
        },
    }


def is_ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def ready_daemonset(env: SimEnv, ns: str, count: int) -> list[Obj]:
    def check() -> list[Obj] | None:
        ds = env.api.get(f"/apis/apps/v1/namespaces/{ns}/daemonsets/web") or {}
        status = ds.get("status") or {}
        if status.get("desiredNumberScheduled") == count and status.get("numberReady") == count:
            pods = [p for p in env.pods(ns, app="web") if is_ready(p)]
            return pods if len(pods) == count else None
        return None

    return wait_until(check, 30, f"DaemonSet {ns}/web with {count} ready pods")


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(v.decode().split("=", 1) for v in raw if b"=" in v)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def curl(topology: Topology, target: Any, url: str) -> str:
    res = topology.exec(target, ["curl", "-s", "-g", "--max-time", "2", url], timeout=10)
    return res.stdout


# ---- tests --------------------------------------------------------------------------------------


def test_daemonset_pods_run_as_processes_and_become_ready(env: SimEnv) -> None:
    # node-role.kubernetes.io/* is a label NodeRestriction keeps from kubelets: set as admin.
    nodes = env.add_nodes(2, **{"node-role.kubernetes.io/edge": ""})
    node_obj = env.api.get(f"/api/v1/nodes/{nodes[0].name}") or {}
    labels = node_obj["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == nodes[0].name
    assert labels["topology.kubernetes.io/zone"] == "zone-a"
    assert labels["node-role.kubernetes.io/edge"] == "" and labels[RUN_LABEL] == env.run
    assert not node_obj["spec"].get("taints"), "the not-ready taint stayed on a Ready node"
    ready = {c["type"]: c["status"] for c in node_obj["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node_obj["spec"]["podCIDRs"] == [nodes[0].pod_cidr_v4, nodes[0].pod_cidr_v6]
    assert node_obj["status"]["allocatable"]["pods"] == "110"
    assert node_obj["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.2"
    lease = env.api.get(
        f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{nodes[0].name}"
    )
    assert lease is not None and lease["spec"]["holderIdentity"] == nodes[0].name

    ns = env.namespace()
    env.api.apply(daemonset(env, ns))
    pods = ready_daemonset(env, ns, 2)
    assert {p["spec"]["nodeName"] for p in pods} == {n.name for n in nodes}
    for pod in pods:
        node = next(n for n in nodes if n.name == pod["spec"]["nodeName"])
        status = pod["status"]
        assert status["phase"] == "Running"
        assert status["podIP"] == node.ipv4 and status["hostIP"] == node.ipv4
        cstatus = status["containerStatuses"][0]
        assert cstatus["ready"] and cstatus["started"] and "running" in cstatus["state"]
        pid = int(cstatus["containerID"].removeprefix("sim://"))
        assert env.sim.pod_processes(ns, pod["metadata"]["name"]) == [pid]
        assert b"kpx_cluster.http_backend" in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert proc_environ(pid)["KUBERNETES_SERVICE_PORT"] == str(env.sim.apiserver_port)
        # The process answers inside the node's netns, with $(NODE_NAME) expanded.
        answer = curl(env.topology, node, "http://127.0.0.1:18080/")
        assert answer.startswith(f"hello from {node.name} "), answer


def test_deployment_pods_get_ips_and_endpoints(env: SimEnv) -> None:
    nodes = env.add_nodes(2)
    ns = env.namespace()
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "api", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "api"}},
            "template": {
                "metadata": {"labels": {"app": "api"}},
                "spec": env.pod_template([http_backend("api", 8080, readinessProbe=probe)]),
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "api", "namespace": ns},
        "spec": {"selector": {"app": "api"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    # Same labels, but its readiness probe aims at a closed port: never Ready, never an endpoint.
    closed = {"httpGet": {"path": "/", "port": 9999}, "periodSeconds": 1}
    unready = env.bare_pod(ns, "unready", [http_backend("api", 8080, readinessProbe=closed)])
    unready["metadata"]["labels"] = {"app": "api", "probe": "closed"}
    env.api.apply(deployment, service, unready)

    def ready_pods() -> list[Obj] | None:
        pods = [p for p in env.pods(ns, app="api") if is_ready(p)]
        return pods if len(pods) == 2 else None

    pods = wait_until(ready_pods, 30, "2 ready Deployment pods")
    assert all(p["metadata"]["name"] != "unready" for p in pods)
    ips = {p["status"]["podIP"] for p in pods}
    for pod in pods:
        node = next(n for n in nodes if n.name == pod["spec"]["nodeName"])
        sim_pod = env.sim_pod(ns, pod["metadata"]["name"])
        assert pod["status"]["podIP"] == sim_pod.ips[0] != node.ipv4
        assert pod["status"]["podIP"].startswith(node.pod_cidr_v4.rsplit(".", 2)[0] + ".")
        assert [i["ip"] for i in pod["status"]["podIPs"]] == list(sim_pod.ips)
        assert proc_environ(sim_pod.pids["api"])["POD_IP"] == sim_pod.ips[0]
        # Reachable across the fabric from the other node.
        other = next(n for n in nodes if n is not node)
        answer = curl(env.topology, other, f"http://{sim_pod.ips[0]}:8080/")
        assert answer.startswith(f"hello from {pod['metadata']['name']} "), answer

    def endpoint_ips() -> set[str] | None:
        slices = env.api.items(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            labelSelector="kubernetes.io/service-name=api",
        )
        endpoints = [ep for s in slices for ep in s.get("endpoints") or []]
        ready = {a for ep in endpoints if ep["conditions"].get("ready") for a in ep["addresses"]}
        unready = {
            a for ep in endpoints if not ep["conditions"].get("ready") for a in ep["addresses"]
        }
        return ready if ready == ips and unready == {unready_ip} else None

    unready_pod = env.pod(ns, "unready") or {}
    unready_ip = unready_pod["status"]["podIP"]
    assert not is_ready(unready_pod)
    assert unready_pod["status"]["containerStatuses"][0]["state"].get("running")
    wait_until(endpoint_ips, 20, f"EndpointSlices listing {ips} ready, {unready_ip} not ready")


def test_configmap_volume_is_written_and_updated(env: SimEnv) -> None:
    env.add_nodes(1)
    ns = env.namespace()
    cm: Obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": ns},
        "data": {"greeting": "hello", "other": "x"},
    }
    script = (
        "import os, time\n"
        "print('env', os.environ['FIRST_GREETING'], flush=True)\n"
        "print('init', open('/scratch/init').read(), flush=True)\n"
        "while True:\n"
        "    print('file', open('/etc/demo/greeting').read(), flush=True)\n"
        "    time.sleep(0.5)\n"
    )
    container = {
        "name": "reader",
        "image": "python",
        "command": ["python3", "-c", script],
        "env": [
            {
                "name": "FIRST_GREETING",
                "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
            }
        ],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/demo"}],
    }
    container["volumeMounts"].append({"name": "scratch", "mountPath": "/scratch"})
    init = {
        "name": "prepare",
        "image": "python",
        "command": ["python3", "-c", "open('/scratch/init', 'w').write('prepared')"],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "settings"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    pod = env.bare_pod(ns, "reader", [container], volumes=volumes, initContainers=[init])
    env.api.apply(cm, pod)
    wait_until(lambda: is_ready(env.pod(ns, "reader") or {}), 30, "pod reader Ready")
    volume = env.sim_pod(ns, "reader").volumes["config"]
    assert (volume / "greeting").read_text() == "hello"
    assert (volume / "..data").is_symlink() and (volume / "greeting").is_symlink()
    wait_until(
        lambda: "file hello" in env.log_of(ns, "reader", "reader"), 10, "the process reading hello"
    )
    assert "env hello" in env.log_of(ns, "reader", "reader")
    assert "init prepared" in env.log_of(ns, "reader", "reader")
    init_status = (env.pod(ns, "reader") or {})["status"]["initContainerStatuses"][0]
    assert init_status["state"]["terminated"]["exitCode"] == 0 and init_status["ready"]

    cm["data"] = {"greeting": "bonjour"}
    env.api.apply(cm)
    wait_until(lambda: "file bonjour" in env.log_of(ns, "reader", "reader"), 15, "the updated file")
    assert (volume / "greeting").read_text() == "bonjour"
    assert not (volume / "other").exists(), "a key removed from the ConfigMap stays in the volume"
    assert len(env.sim.pod_processes(ns, "reader")) == 1


def test_pod_deletion_and_daemonset_rolling_update(env: SimEnv) -> None:
    nodes = env.add_nodes(2)
    ns = env.namespace()
    env.api.apply(daemonset(env, ns, version="1"))
    pods = ready_daemonset(env, ns, 2)

    # Delete one pod: its process dies, the DaemonSet controller's replacement runs.
    victim = pods[0]
    name, node_name = victim["metadata"]["name"], victim["spec"]["nodeName"]
    old_pid = env.sim.pod_processes(ns, name)[0]
    env.cluster.kubectl("-n", ns, "delete", "pod", name, "--wait=true", "--timeout=30s")
    assert not alive(old_pid), "the deleted pod's process still runs"
    pods = ready_daemonset(env, ns, 2)
    replacement = next(p for p in pods if p["spec"]["nodeName"] == node_name)
    assert replacement["metadata"]["name"] != name
    new_pids = env.sim.pod_processes(ns, replacement["metadata"]["name"])
    assert new_pids and new_pids != [old_pid] and alive(new_pids[0])
    node = next(n for n in nodes if n.name == node_name)
    assert curl(env.topology, node, "http://127.0.0.1:18080/").startswith("hello from")

    # Rolling update (maxUnavailable 1): pods are replaced one at a time.
    old_uids = {p["metadata"]["uid"] for p in pods}
    env.api.apply(daemonset(env, ns, version="2"))
    samples: list[tuple[int, int, int]] = []  # (old pods left, ready pods, ready new pods)

    def updated() -> bool:
        current = env.pods(ns, app="web")
        live = [p for p in current if not p["metadata"].get("deletionTimestamp")]
        old = [p for p in live if p["metadata"]["uid"] in old_uids]
        ready = [p for p in live if is_ready(p)]
        ready_new = [p for p in ready if p["metadata"]["uid"] not in old_uids]
        samples.append((len(old), len(ready), len(ready_new)))
        return len(ready_new) == 2 and not old

    wait_until(updated, 45, "the rolling update", interval=0.1)
    assert min(ready for _, ready, _ in samples) >= 1, f"both pods were down at once: {samples}"
    # One old pod at a time: never none of them left before a new one is ready.
    assert not any(old == 0 and new == 0 for old, _, new in samples), samples
    assert any(new == 1 for _, _, new in samples), f"not one by one: {samples}"
    for pod in env.pods(ns, app="web"):
        pids = env.sim.pod_processes(ns, pod["metadata"]["name"])
        assert len(pids) == 1 and proc_environ(pids[0])["VERSION"] == "2"


def test_projected_service_account_token_works(env: SimEnv) -> None:
    env.add_nodes(1)
    ns = env.namespace()
    env.cluster.kubectl("-n", ns, "create", "serviceaccount", "reader")
    script = (
        "import os, ssl, time, urllib.error, urllib.request\n"
        "sa = os.environ['KPX_SERVICEACCOUNT_DIR']\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "ns = open(sa + '/namespace').read()\n"
        "host = os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']\n"
        "url = 'https://%s:%s/api/v1/namespaces/%s/secrets' % (*host, ns)\n"
        "while True:\n"
        "    token = open('/var/run/secrets/kubernetes.io/serviceaccount/token').read()\n"
        "    req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})\n"
        "    try:\n"
        "        code = urllib.request.urlopen(req, context=ctx, timeout=2).status\n"
        "    except urllib.error.HTTPError as err:\n"
        "        code = err.code\n"
        "    except Exception as err:\n"
        "        code = repr(err)\n"
        "    print('status', code, flush=True)\n"
        "    time.sleep(0.5)\n"
    )
    container = {"name": "client", "image": "python", "command": ["python3", "-c", script]}
    # One client in the node's netns, one in a pod netns (with the optional loopback relay).
    env.sim.pod_apiserver_access = True
    pod = env.bare_pod(ns, "client", [container], hostNetwork=True, serviceAccountName="reader")
    pod_net = env.bare_pod(ns, "client-podnet", [container], serviceAccountName="reader")
    env.api.apply(pod, pod_net)
    for name in ("client", "client-podnet"):
        wait_until(lambda n=name: "status 403" in env.log_of(ns, n), 30, f"a 403 ({name})")
        assert "status 200" not in env.log_of(ns, name)

    sa_dir = next(
        iter(
            v
            for k, v in env.sim_pod(ns, "client").volumes.items()
            if k.startswith("kube-api-access")
        )
    )
    claims = json.loads(
        base64.urlsafe_b64decode((sa_dir / "token").read_text().split(".")[1] + "==")
    )
    assert claims["kubernetes.io"]["pod"]["name"] == "client"
    assert claims["kubernetes.io"]["serviceaccount"]["name"] == "reader"
    assert (sa_dir / "namespace").read_text() == ns
    assert "BEGIN CERTIFICATE" in (sa_dir / "ca.crt").read_text()

    env.cluster.kubectl("-n", ns, "create", "role", "secrets", "--verb=list", "--resource=secrets")
    env.cluster.kubectl(
        "-n",
        ns,
        "create",
        "rolebinding",
        "secrets",
        "--role=secrets",
        f"--serviceaccount={ns}:reader",
    )
    for name in ("client", "client-podnet"):
        wait_until(lambda n=name: "status 200" in env.log_of(ns, n), 20, f"a 200 ({name})")


def test_exits_restart_and_restart_policies(env: SimEnv) -> None:
    env.add_nodes(1)
    ns = env.namespace()
    crash = "import sys, time; print('run', flush=True); time.sleep(0.3); sys.exit(3)"
    crashing = env.bare_pod(
        ns, "crashing", [{"name": "c", "image": "python", "command": ["python3", "-c", crash]}]
    )
    done = env.bare_pod(
        ns,
        "done",
        [{"name": "c", "image": "python", "command": ["python3", "-c", "pass"]}],
        restartPolicy="Never",
    )
    failed = env.bare_pod(
        ns,
        "failed",
        [{"name": "c", "image": "python", "command": ["python3", "-c", "exit(2)"]}],
        restartPolicy="Never",
    )
    liveness = {"tcpSocket": {"port": 9999}, "periodSeconds": 1, "failureThreshold": 2}
    unhealthy = env.bare_pod(ns, "unhealthy", [http_backend("web", 8080, livenessProbe=liveness)])
    env.api.apply(crashing, done, failed, unhealthy)

    def phase(name: str) -> str:
        return str(((env.pod(ns, name) or {}).get("status") or {}).get("phase"))

    wait_until(lambda: phase("done") == "Succeeded", 20, "pod done Succeeded")
    wait_until(lambda: phase("failed") == "Failed", 20, "pod failed Failed")
    terminated = (env.pod(ns, "failed") or {})["status"]["containerStatuses"][0]["state"]
    assert terminated["terminated"]["exitCode"] == 2

    def restarted(name: str, count: int) -> Obj | None:
        statuses = ((env.pod(ns, name) or {}).get("status") or {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= count else None

    status = wait_until(lambda: restarted("crashing", 2), 30, "crashing restarted twice")
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert phase("crashing") == "Running"
    # The third run is started when restartCount reads 2; its first line may come a moment later.
    wait_until(lambda: env.log_of(ns, "crashing").count("run") >= 3, 15, "a third run logged")

    status = wait_until(lambda: restarted("unhealthy", 1), 30, "a liveness restart")
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert len(env.sim.pod_processes(ns, "unhealthy")) <= 1
