"""`make demo`: a local cluster, three simulated nodes with kpx agents, and a demo app.

`up` starts a background process (`serve`) that owns the nodes (network namespaces), the
agents and the demo backends, waits until it reports ready, then shows traffic through the
Service IP. `down` stops that process (which removes every namespace and process it made) and
the control plane.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kpx_api.agentconfig import agent_config_from_spec, dump_agent_config
from kpx_api.proxyconfiguration import parse_spec

from .binaries import kubernetes_bin_dir
from .controlplane import DEFAULT_ROOT, Cluster
from .kubeconfig import write_kubeconfig
from .netns import Node, Topology

REPO = Path(__file__).resolve().parents[2]
STATE = DEFAULT_ROOT / "demo"
READY, FAILED, PIDFILE, LOG = (STATE / f for f in ("ready.json", "failed", "pid", "demo.log"))
NODES = ("node-1", "node-2", "node-3")
ZONES = {"node-1": "zone-a", "node-2": "zone-a", "node-3": "zone-b"}
AGENT_NAMESPACE = "kpx-system"

# What the agent needs, and nothing more: read Services, EndpointSlices, Namespaces, Nodes.
AGENT_RULES = [
    {"apiGroups": [""], "resources": ["services", "namespaces", "nodes"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["get", "list", "watch"]},
]  # fmt: skip


def _apply(cluster: Cluster, *objs: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
    )


def _agent_credentials(cluster: Cluster, directory: Path) -> Path:
    """A least-privilege ServiceAccount for the agents, and a token file for it."""
    _apply(
        cluster,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "kpx-agent", "namespace": AGENT_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "kpx-agent"}, "rules": AGENT_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kpx-agent"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "kpx-agent"},
         "subjects": [{"kind": "ServiceAccount", "name": "kpx-agent",
                       "namespace": AGENT_NAMESPACE}]},
    )  # fmt: skip
    token = cluster.kubectl(
        "-n", AGENT_NAMESPACE, "create", "token", "kpx-agent", "--duration=48h"
    ).stdout.strip()
    token_file = directory / "agent.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return token_file


def _register_node(cluster: Cluster, node: Node) -> None:
    _apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": {"topology.kubernetes.io/zone": ZONES[node.name],
                           "kubernetes.io/hostname": node.name},
            },
            "spec": {"podCIDRs": [node.pod_cidr_v4, node.pod_cidr_v6],
                     "podCIDR": node.pod_cidr_v4},
        },
    )  # fmt: skip
    status = {
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node.ipv4},
                {"type": "InternalIP", "address": node.ipv6},
                {"type": "Hostname", "address": node.name},
            ],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KpxDemo"}],
        }
    }
    cluster.kubectl("patch", "node", node.name, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))  # fmt: skip


def _start_pod(cluster: Cluster, topo: Topology, node: Node, name: str, ns: str) -> str:
    """A demo backend: a process in a pod netns, and the Pod object a kubelet would report."""
    pod = topo.add_pod(node, name)
    topo.run_ready(pod, topo.python_argv("kpx_cluster.http_backend", "--name", name))
    _apply(cluster, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "web"}},
        "spec": {"nodeName": node.name, "automountServiceAccountToken": False,
                 "containers": [{"name": "web", "image": "kpx-demo/http-backend",
                                 "ports": [{"containerPort": 8080}]}]},
    })  # fmt: skip
    status = {"status": {
        "phase": "Running", "podIP": pod.ipv4,
        "podIPs": [{"ip": pod.ipv4}, {"ip": pod.ipv6}],
        "conditions": [{"type": "Ready", "status": "True"},
                       {"type": "ContainersReady", "status": "True"}],
    }}  # fmt: skip
    cluster.kubectl("-n", ns, "patch", "pod", name, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))  # fmt: skip
    return pod.netns


def serve() -> None:
    """Build everything, report ready, then hold it until SIGTERM."""
    cluster = Cluster("kpx")
    if not cluster.is_running():
        cluster.up()
    spec_doc = yaml.safe_load((REPO / "examples" / "proxyconfig.yaml").read_text())
    config = dump_agent_config(agent_config_from_spec(parse_spec(spec_doc["spec"])))
    with Topology() as topo:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        nodes = [topo.add_node(n) for n in NODES]
        topo.expose_host_port(cluster.apiserver_port)
        token = _agent_credentials(cluster, topo.tmpdir)
        (topo.tmpdir / "agent.yaml").write_text(config)
        kubeconfig = write_kubeconfig(
            topo.tmpdir / "agent.kubeconfig",
            server=f"https://127.0.0.1:{cluster.apiserver_port}",
            ca=cluster.ca_file,
            user="kpx-agent",
            token_file=token,
        )
        for node in nodes:
            _register_node(cluster, node)
            topo.run(
                node,
                [sys.executable, "-m", "kpx_agent.cli", "--mode", "nftables",
                 "--node-name", node.name, "--config", str(topo.tmpdir / "agent.yaml"),
                 "--kubeconfig", str(kubeconfig)],
                stdout=(STATE / f"agent-{node.name}.log").open("ab"),
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        cluster.create_namespace("demo")
        backends = [_start_pod(cluster, topo, node, f"web-{i + 1}", "demo")
                    for i, node in enumerate(nodes)]  # fmt: skip
        _apply(cluster, {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"type": "NodePort", "selector": {"app": "web"},
                     "ipFamilyPolicy": "PreferDualStack",
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        })  # fmt: skip
        client = topo.add_pod(nodes[0], "client")
        svc = json.loads(cluster.kubectl("-n", "demo", "get", "svc", "web", "-o", "json").stdout)
        READY.write_text(json.dumps({
            "clusterIPs": svc["spec"]["clusterIPs"],
            "nodePort": svc["spec"]["ports"][0]["nodePort"],
            "client": client.netns,
            "nodes": {n.name: {"netns": n.netns, "ip": n.ipv4} for n in nodes},
            "backends": backends,
            "agentLogs": str(STATE),
        }, indent=2))  # fmt: skip
        while True:
            time.sleep(3600)


def _curl(netns: str, url: str) -> str:
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "curl", "-s", "-g", "--max-time", "2", url],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return proc.stdout.strip() or f"(no answer: curl exit {proc.returncode})"


def _running_pid() -> int | None:
    try:
        pid = int(PIDFILE.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def up(timeout: float = 240) -> int:
    if _running_pid() is not None and READY.exists():
        print("the demo already runs; `make demo-down` stops it")
        return _show()
    STATE.mkdir(parents=True, exist_ok=True)
    for f in (READY, FAILED):
        f.unlink(missing_ok=True)
    log = LOG.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kpx_cluster.demo", "serve"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    PIDFILE.write_text(str(proc.pid))
    print("starting the control plane, 3 nodes, agents and the demo app...", flush=True)
    deadline = time.monotonic() + timeout
    while not READY.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"the demo failed to start; see {LOG}", file=sys.stderr)
            print(LOG.read_text()[-3000:], file=sys.stderr)
            down()
            return 1
        time.sleep(0.5)
    time.sleep(3)  # the agents' first sync
    return _show()


def _show() -> int:
    info = json.loads(READY.read_text())
    cluster = Cluster("kpx")
    vip = info["clusterIPs"][0]
    print("\n$ kubectl -n demo get pods,svc,endpointslices -o wide")
    print(cluster.kubectl("-n", "demo", "get", "pods,svc,endpointslices", "-o", "wide").stdout)
    print(f"$ ip netns exec {info['client']} curl -s http://{vip}/    (6 times)")
    for _ in range(6):
        print("  " + _curl(info["client"], f"http://{vip}/"))
    if len(info["clusterIPs"]) > 1:
        vip6 = info["clusterIPs"][1]
        print(f"$ ip netns exec {info['client']} curl -s http://[{vip6}]/")
        print("  " + _curl(info["client"], f"http://[{vip6}]/"))
    n2 = info["nodes"]["node-2"]
    node_url = f"http://{info['nodes']['node-1']['ip']}:{info['nodePort']}/"
    print(f"$ ip netns exec {n2['netns']} curl -s {node_url}    (NodePort, from node-2)")
    print("  " + _curl(n2["netns"], node_url))
    print("\nThe cluster keeps running. Explore:")
    print(f"  export PATH={kubernetes_bin_dir()}:$PATH KUBECONFIG={cluster.kubeconfig}")
    print("  kubectl -n demo get svc,endpointslices")
    print(f"  ip netns exec {info['client']} curl -s http://{vip}/")
    print(f"  ip netns exec {info['nodes']['node-1']['netns']} nft list table ip kpx")
    print("  kubectl label namespace demo networking.k8s.io/kube-proxy=disabled  # opt out")
    print(f"  agent logs: {info['agentLogs']}/agent-node-*.log")
    print("Stop everything with: make demo-down")
    return 0


def down() -> int:
    pid = _running_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _running_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    stopped = Cluster("kpx").down()
    for f in (READY, FAILED, PIDFILE):
        f.unlink(missing_ok=True)
    print(f"demo stopped; control plane: {', '.join(stopped) or 'was not running'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kpx-demo", description=__doc__)
    parser.add_argument("command", choices=("up", "down", "serve"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve()
        return 0
    return up() if args.command == "up" else down()


if __name__ == "__main__":
    sys.exit(main())
