"""`make demo`: a local cluster of three real kubelet nodes, the kpx operator and agents from
the project's images, and a demo app.

`up` starts a background process (`serve`) that owns the nodes (`RealCluster`: the control
plane, three kubelets with containerd in network namespaces, cluster DNS), installs kpx as a
user does (the CRD, the operator's manifests, examples/proxyconfig.yaml: `kubelets.install`),
runs the demo app, waits until everything reports ready, then shows traffic through the
Service IPs and a NodePort. `down` stops that process, which stops every node and the control
plane and removes every namespace, cgroup and file; what a killed process left is swept.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import yaml

from .binaries import kubernetes_bin_dir
from .controlplane import DEFAULT_ROOT, Cluster
from .kubelets import install
from .kubelets.cluster import RealCluster, sweep
from .kubelets.static_images import BUSYBOX_IMAGE

#: the cluster's name (`kpx`: the demo's kubeconfig is /dev/shm/kpx/kpx/admin.kubeconfig);
#: tests run a demo of their own under another name (KPX_DEMO_CLUSTER)
NAME = os.environ.get("KPX_DEMO_CLUSTER", "kpx")
REPO = Path(__file__).resolve().parents[2]
STATE = DEFAULT_ROOT / ("demo" if NAME == "kpx" else f"demo-{NAME}")
READY, FAILED, PIDFILE, LOG = (STATE / f for f in ("ready.json", "failed", "pid", "demo.log"))
NODES = 3
ZONES = {"node-1": "zone-a", "node-2": "zone-a", "node-3": "zone-b"}
#: each backend answers its pod's name (busybox httpd: the image every node imported)
SERVE = "mkdir -p /w && echo $POD_NAME > /w/index.html && exec httpd -f -p 8080 -h /w"

DEMO_APP = [
    {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "demo"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 1,
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "DoNotSchedule",
                            "labelSelector": {"matchLabels": {"app": "web"}},
                        }
                    ],
                    "containers": [
                        {
                            "name": "web",
                            "image": BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["sh", "-c", SERVE],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                }
                            ],
                            "ports": [{"containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"path": "/", "port": 8080},
                                "periodSeconds": 2,
                            },
                        }
                    ],
                },
            },
        },
    },
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "demo"},
        "spec": {
            "type": "NodePort",
            "selector": {"app": "web"},
            "ipFamilyPolicy": "PreferDualStack",
            "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
        },
    },
    {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client", "namespace": "demo"},
        "spec": {
            "nodeName": "node-1",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "client",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "86400"],
                }
            ],
        },
    },
]


#: What each condition of a ProxyConfiguration reads when all is well.
HEALTHY: Final = {
    "Ready": "True",
    "Progressing": "False",
    "Degraded": "False",
    "Deprecated": "False",
    "Preflight": "True",
    "ModeSwitch": "True",
    "Reconciling": "False",
    "Stalled": "False",
}


def unhealthy_conditions(pxc: dict[str, Any]) -> dict[str, str]:
    """type -> "status reason: message" of each condition that does not read healthy; every
    type in HEALTHY but Preflight and ModeSwitch (present only with a reason to be) must be
    there."""
    conds = {c["type"]: c for c in (pxc.get("status") or {}).get("conditions") or []}
    out = {
        t: "missing"
        for t in ("Ready", "Progressing", "Degraded", "Deprecated", "Reconciling", "Stalled")
        if t not in conds
    }
    for type_, c in conds.items():
        if HEALTHY.get(type_) != c["status"]:
            out[type_] = f"{c['status']} {c['reason']}: {c.get('message', '')}"
    return out


def proxy_configuration() -> dict[str, Any]:
    """examples/proxyconfig.yaml with conntrack.maxPerCore 0, as kind gives kube-proxy: the
    nodes are network namespaces of this one machine (kind's are containers), whose conntrack
    table size is the machine's own (global, read-only in a node's namespace), so it is left
    alone; the per-namespace timeouts are applied on each node."""
    pxc = dict(yaml.safe_load((REPO / "examples" / "proxyconfig.yaml").read_text()))
    pxc["spec"].setdefault("conntrack", {})["maxPerCore"] = 0
    return pxc


def _wait(what: str, check: Callable[[], bool], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: {what} not reached after {timeout:.0f}s")
        time.sleep(1)
    print(f"demo: {what}", flush=True)


def _json(cluster: Cluster, *args: str) -> dict[str, Any]:
    out = cluster.kubectl(*args, "-o", "json", check=False)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else {}


def serve() -> None:
    """Build everything, report ready, then hold it until SIGTERM.

    Everything after the nodes is what a user does on a real cluster: install the CRD and the
    operator's manifests, apply a ProxyConfiguration and an app. The operator's Deployment,
    the agents' DaemonSet and the app run from images every node imported (never pulled).
    """
    rc = RealCluster(NAME, nodes=NODES, archives=install.archives("kpx"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    rc.up(timeout=240)
    try:
        cluster = rc.cluster
        print(f"demo: {NODES} nodes Ready", flush=True)
        for node, zone in ZONES.items():
            cluster.kubectl("label", "node", node, f"topology.kubernetes.io/zone={zone}")
        status = install.install_kpx(rc, "nftables", proxy_configuration())
        print(f"demo: ProxyConfiguration default Ready on {status['readyNodes']} nodes", flush=True)
        _wait(
            "every condition of ProxyConfiguration default healthy",
            lambda: not (unhealthy_conditions(_json(cluster, "get", "pxc", "default"))),
        )
        cluster.create_namespace("demo")
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": DEMO_APP}),
        )
        _wait(
            "demo app ready",
            lambda: (
                _json(cluster, "-n", "demo", "get", "deploy", "web")
                .get("status", {})
                .get("readyReplicas", 0)
                == 3
            ),
        )
        _wait(
            "client pod running",
            lambda: (
                _json(cluster, "-n", "demo", "get", "pod", "client").get("status", {}).get("phase")
                == "Running"
            ),
        )
        svc = _json(cluster, "-n", "demo", "get", "svc", "web")
        READY.write_text(
            json.dumps(
                {
                    "clusterIPs": svc["spec"]["clusterIPs"],
                    "nodePort": svc["spec"]["ports"][0]["nodePort"],
                    "nodes": {n: {"netns": p.netns, "ip": p.ipv4} for n, p in rc.plans.items()},
                },
                indent=2,
            )
        )
        while True:
            time.sleep(3600)
    finally:
        rc.down()


def _curl(netns: str, url: str) -> str:
    """From a node's network namespace (it routes every node, pod and Service address)."""
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "curl", "-s", "-g", "--max-time", "2", url],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or f"(no answer: curl exit {proc.returncode})"


def _from_client(cluster: Cluster, url: str) -> str:
    """From the demo's client pod, through kpx on its node (`timeout`, not wget's `-T`: Debian's
    static busybox 1.35 crashes on `-T`)."""
    proc = cluster.kubectl(
        "-n", "demo", "exec", "client", "--", "timeout", "3", "wget", "-qO-", url, check=False
    )
    return proc.stdout.strip() or f"(no answer: wget exit {proc.returncode})"


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
    if Cluster(NAME).is_running():  # not the demo's: never stop someone else's cluster
        print(
            f"a cluster named {NAME!r} already runs; stop it first (`proxy-cluster down`)",
            file=sys.stderr,
        )
        return 1
    STATE.mkdir(parents=True, exist_ok=True)
    for f in (READY, FAILED):
        f.unlink(missing_ok=True)
    log = LOG.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kpx_cluster.demo", "serve"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    PIDFILE.write_text(str(proc.pid))
    print("starting the control plane, 3 real kubelet nodes, kpx and the demo app...", flush=True)
    deadline = time.monotonic() + timeout
    while not READY.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"the demo failed to start; see {LOG}", file=sys.stderr)
            print(LOG.read_text()[-3000:], file=sys.stderr)
            _stop_serve()  # its RealCluster removes what it made
            down()
            return 1
        time.sleep(0.5)
    time.sleep(3)  # the agents' first sync
    return _show()


def _show() -> int:
    info = json.loads(READY.read_text())
    cluster = Cluster(NAME)
    vip = info["clusterIPs"][0]
    print("\n$ kubectl get proxyconfigurations")
    print(cluster.kubectl("get", "proxyconfigurations").stdout)
    print("$ kubectl get pxc default -o yaml    (status.conditions: type, status, reason)")
    pxc = _json(cluster, "get", "pxc", "default")
    for cond in (pxc.get("status") or {}).get("conditions") or []:
        print(f"  {cond['type']:<12} {cond['status']:<6} {cond['reason']}")
    if bad := unhealthy_conditions(pxc):
        print(f"  NOT HEALTHY: {bad}")
    print()
    print("$ kubectl -n kpx-system get daemonsets,pods -o wide")
    print(cluster.kubectl("-n", "kpx-system", "get", "daemonsets,pods", "-o", "wide").stdout)
    print("$ kubectl -n demo get pods,svc,endpointslices -o wide")
    print(cluster.kubectl("-n", "demo", "get", "pods,svc,endpointslices", "-o", "wide").stdout)
    print(f"$ kubectl -n demo exec client -- wget -qO- http://{vip}/    (6 times)")
    for _ in range(6):
        print("  " + _from_client(cluster, f"http://{vip}/"))
    if len(info["clusterIPs"]) > 1:
        vip6 = info["clusterIPs"][1]
        print(f"$ kubectl -n demo exec client -- wget -qO- http://[{vip6}]/")
        print("  " + _from_client(cluster, f"http://[{vip6}]/"))
    n2 = info["nodes"]["node-2"]
    node_url = f"http://{info['nodes']['node-1']['ip']}:{info['nodePort']}/"
    print(f"$ ip netns exec {n2['netns']} curl -s {node_url}    (NodePort, from node-2)")
    print("  " + _curl(n2["netns"], node_url))
    print("\nThe cluster keeps running. Explore:")
    print(f"  export PATH={kubernetes_bin_dir()}:$PATH KUBECONFIG={cluster.kubeconfig}")
    print("  kubectl -n demo get svc,endpointslices")
    print(f"  kubectl -n demo exec client -- wget -qO- http://{vip}/")
    print(f"  ip netns exec {info['nodes']['node-1']['netns']} nft list table ip kpx")
    print("  kubectl label namespace demo networking.k8s.io/kube-proxy=disabled  # opt out")
    print("  kubectl get pxc default -o yaml      # status conditions written by the operator")
    print(f"  demo log: {LOG}")
    print("Stop everything with: make demo-down")
    return 0


def _stop_serve(timeout: float = 90) -> None:
    """SIGTERM to `serve`: its RealCluster stops the nodes and the control plane."""
    pid = _running_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _running_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def down() -> int:
    _stop_serve()
    left: list[str] = []
    state = Cluster(NAME).state_dir / "real-nodes.json"
    with contextlib.suppress(OSError, ValueError):  # what a killed `serve` left
        left = sweep(str(json.loads(state.read_text())["prefix"]))
    stopped = Cluster(NAME).down()
    if left:
        print(f"demo: could not remove {left}", file=sys.stderr)
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
