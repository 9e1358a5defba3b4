"""Real kubelets in the development harness (kpx_cluster.kubelets, docs/real-kubelets.md).

Two real nodes (kubelet v1.36.2 + containerd + Debian's CNI plugins, each in its own network
and mount namespace) and the control plane in a netns of its own: both Nodes become Ready, a
busybox pod runs on each (its image imported, never pulled), cluster DNS answers, each pod
reaches the other across the nodes (through `kubectl exec`, so the apiserver dials the kubelet
from its netns), and `down` leaves no process, netns, link, mount or cgroup behind, with the
host's routes and ruleset as they were.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kpx_cluster import netns
from kpx_cluster.controlplane import DEFAULT_ROOT
from kpx_cluster.kubelets import cgroups, debian_images, static_images
from kpx_cluster.kubelets.cluster import RealCluster
from kpx_cluster.kubelets.config import KUBELET_SYSCTLS
from kpx_cluster.kubelets.static_images import BUSYBOX_IMAGE

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

NAMESPACE = "real"


def _out(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def host_network_state() -> dict[str, str]:
    """The host netns's routes, rules and firewall, in forms that do not change with traffic
    (no counters, no timestamps)."""
    iptables = [
        re.sub(r"\[\d+:\d+\]", "", line)
        for tool in ("iptables-save", "ip6tables-save")
        for line in _out(tool).splitlines()
        if not line.startswith("#")
    ]
    return {
        "routes4": _out("ip", "-4", "route", "show", "table", "all"),
        "routes6": _out("ip", "-6", "route", "show", "table", "all"),
        "rules4": _out("ip", "-4", "rule"),
        "rules6": _out("ip", "-6", "rule"),
        "nftables": _out("nft", "-s", "list", "ruleset"),
        "iptables": "\n".join(iptables),
    }


def host_sysctls() -> dict[str, str]:
    return {key: Path("/proc/sys", key).read_text() for key in KUBELET_SYSCTLS}


NODE_PATHS = ("/run", "/var/lib", "/var/log", "/proc/sys/")
NODE_PATH_PREFIXES = ("/var/lib/kubelet", "/var/lib/containerd", "/var/lib/cni", "/run/containerd")


def host_mounts(state_dir: Path) -> list[str]:
    """The host's mount points a node's mounts would show up at if they leaked."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point in NODE_PATHS[:3] or point.startswith(
            (*NODE_PATHS[3:], *NODE_PATH_PREFIXES, str(state_dir))
        ):
            found.append(point)
    return sorted(found)


def processes_mentioning(*needles: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found.append(f"{entry.name}: {cmdline}")
    return found


NAME = f"real-{os.getpid()}"


@pytest.fixture(scope="module")
def before() -> dict[str, Any]:
    """The host as it was before the cluster: its network state and the mounts."""
    return {
        "network": host_network_state(),
        "mounts": host_mounts(DEFAULT_ROOT / NAME),
        "sysctls": host_sysctls(),
    }


@pytest.fixture(scope="module")
def real(before: dict[str, Any]) -> Iterator[RealCluster]:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    archives = static_images.ensure(log=lambda _: None, wanted=(debian_images.AGNHOST,))
    rc = RealCluster(NAME, nodes=2, archives=archives)
    rc.up(timeout=120)
    try:
        yield rc
    finally:
        rc.down()


def _pods(rc: RealCluster) -> dict[str, dict[str, Any]]:
    got = rc.cluster.kubectl("-n", NAMESPACE, "get", "pods", "-o", "json")
    return {p["metadata"]["name"]: p for p in json.loads(got.stdout)["items"]}


def pod_manifest(name: str, node: str) -> dict[str, Any]:
    """busybox serving its own name over HTTP on 8080, pinned to `node`."""
    script = (
        "mkdir -p /tmp/w && echo $HOSTNAME > /tmp/w/index.html && exec httpd -f -p 8080 -h /tmp/w"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "web",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script],
                    "ports": [{"containerPort": 8080}],
                }
            ],
        },
    }


def test_both_nodes_register_ready_with_their_addresses_and_pod_cidrs(real: RealCluster) -> None:
    nodes = real.nodes()
    assert sorted(nodes) == ["node-1", "node-2"]
    for name, node in nodes.items():
        plan = real.plans[name]
        assert real.is_ready(node)
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.36.2"
        assert info["containerRuntimeVersion"].startswith("containerd://")
        internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == [plan.ipv4, plan.ipv6]
        assert node["spec"]["podCIDRs"] == [plan.pod_cidr_v4, plan.pod_cidr_v6]


@pytest.fixture(scope="module")
def pods(real: RealCluster) -> dict[str, dict[str, Any]]:
    """One busybox pod per node, Running."""
    real.cluster.create_namespace(NAMESPACE)
    wanted = {f"web-{n}": n for n in real.node_names}
    manifests = [pod_manifest(pod, node) for pod, node in wanted.items()]
    real.cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": manifests}),
    )
    deadline = time.monotonic() + 90
    while True:
        got = _pods(real)
        phases = {name: got.get(name, {}).get("status", {}).get("phase") for name in wanted}
        if all(p == "Running" for p in phases.values()):
            return got
        assert time.monotonic() < deadline, f"pods not Running: {phases}"
        time.sleep(0.5)


def test_a_pod_runs_on_each_node_with_an_address_of_its_pod_cidr(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    for name in real.node_names:
        pod = pods[f"web-{name}"]
        plan = real.plans[name]
        assert pod["spec"]["nodeName"] == name
        v4, v6 = (ipaddress.ip_address(entry["ip"]) for entry in pod["status"]["podIPs"])
        assert v4 in ipaddress.ip_network(plan.pod_cidr_v4)
        assert v6 in ipaddress.ip_network(plan.pod_cidr_v6)


def test_pods_reach_each_other_across_nodes(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    """From inside each pod (kubectl exec: the apiserver, in its netns, dials the kubelet),
    an HTTP request to the other node's pod, by its IPv4 and its IPv6 address, answers with
    that pod's name.
    (No `wget -T`: Debian's static busybox 1.35 crashes on it.)"""
    one, two = (f"web-{n}" for n in real.node_names)
    for client, server in ((one, two), (two, one)):
        v4, v6 = (entry["ip"] for entry in pods[server]["status"]["podIPs"])
        for ip in (v4, f"[{v6}]"):
            got = real.cluster.kubectl(
                "-n",
                NAMESPACE,
                "exec",
                client,
                "--",
                "timeout",
                "10",
                "wget",
                "-qO-",
                f"http://{ip}:8080/",
            )
            assert got.stdout.strip() == server, ip


def test_the_apiservers_pod_proxy_reaches_a_pod_on_each_node(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    """The apiserver dials pods from its own netns (routes to every pod CIDR): its pod proxy,
    which Kubernetes' e2e suite uses, answers for a pod on each node."""
    for name in real.node_names:
        pod = f"web-{name}"
        got = real.cluster.kubectl(
            "get", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}:8080/proxy/"
        )
        assert got.stdout.strip() == pod


def test_a_node_netns_reaches_the_other_nodes_pod(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    plan = real.plans["node-1"]
    ip = pods["web-node-2"]["status"]["podIP"]
    got = subprocess.run(
        ["ip", "netns", "exec", plan.netns, "busybox", "wget", "-qO-", f"http://{ip}:8080/"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert got.stdout.strip() == "web-node-2", got.stderr


def test_cluster_dns_answers_a_pod_from_its_own_pod(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    """CoreDNS (kube-system/coredns, built here) runs on a node and answers a pod for the
    kubernetes Service's name, asked at its pod IP (the kube-dns Service's address needs a
    service proxy: tests/e2e/test_real_kubelets_kpx.py)."""
    got = real.cluster.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-dns", "-o", "json"
    )
    (dns_pod,) = json.loads(got.stdout)["items"]
    answer = real.cluster.kubectl(
        "-n",
        NAMESPACE,
        "exec",
        "web-node-1",
        "--",
        "nslookup",
        "kubernetes.default.svc.cluster.local",
        dns_pod["status"]["podIP"],
    ).stdout
    assert "10.96.0.1" in answer, answer


def test_agnhost_serves_its_hostname_to_a_pod_on_the_other_node(
    real: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    """The e2e suite's agnhost image (built here from the pinned release) runs `netexec`."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "netexec", "namespace": NAMESPACE},
        "spec": {
            "nodeName": "node-2",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "agnhost",
                    "image": static_images.AGNHOST_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": ["netexec", "--http-port=8080", "--udp-port=-1"],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                }
            ],
        },
    }
    real.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    real.cluster.kubectl(
        "-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/netexec", "--timeout=60s", timeout=70
    )
    ip = _pods(real)["netexec"]["status"]["podIP"]
    got = real.cluster.kubectl(
        "-n",
        NAMESPACE,
        "exec",
        "web-node-1",
        "--",
        "timeout",
        "10",
        "wget",
        "-qO-",
        f"http://{ip}:8080/hostname",
    )
    assert got.stdout.strip() == "netexec"


def test_no_namespace_of_the_cluster_routes_off_the_machine(real: RealCluster) -> None:
    """The control plane's and every node's netns have no route but the fabric, the pod CIDRs
    and the Service CIDRs: an address elsewhere (here a documentation address and the host's
    own default gateway) is unroutable where a packet to it starts."""
    gateway = _out("ip", "-4", "route", "show", "default").split()
    elsewhere = ["198.51.100.7", *gateway[2:3]]
    for ns in [str(real.cluster.netns), *(p.netns for p in real.plans.values())]:
        for address in elsewhere:
            got = subprocess.run(
                ["ip", "-n", ns, "route", "get", address],
                capture_output=True,
                text=True,
                check=False,
            )
            assert got.returncode != 0 and "unreachable" in got.stderr, (ns, address, got)


def test_the_hosts_kernel_settings_stay_as_they_were(
    real: RealCluster, before: dict[str, Any]
) -> None:
    """The kubelets set vm.overcommit_memory, kernel.panic, ... at start: on files over those
    /proc/sys entries in their own mount namespaces, never on the host's."""
    assert host_sysctls() == before["sysctls"]


def test_node_mounts_stay_in_the_nodes(real: RealCluster, before: dict[str, Any]) -> None:
    """Running pods (overlay roots, secrets, pod netns files) and the nodes' own /run, /var/lib
    and /var/log: none of it shows on the host."""
    assert host_mounts(real.cluster.state_dir) == before["mounts"]


def test_a_stopped_apiserver_starts_again_in_the_control_planes_netns(real: RealCluster) -> None:
    """`stop_component` / `start_component` and `compact_etcd` (what `make chaos` does to the
    control plane): the new apiserver runs in the control plane's netns, where etcd answers on
    its loopback, and the nodes are served by it again."""

    def pid_of(name: str) -> int:
        state = json.loads((real.cluster.state_dir / "state.json").read_text())
        return int(next(c["pid"] for c in state["components"] if c["name"] == name))

    def netns_of(pid: int) -> str:
        return os.readlink(f"/proc/{pid}/ns/net")

    old = pid_of("kube-apiserver")
    argv = real.cluster.stop_component("kube-apiserver")
    real.cluster.start_component("kube-apiserver", argv, timeout=60)
    new = pid_of("kube-apiserver")
    assert new != old
    assert netns_of(new) == netns_of(pid_of("etcd")) != netns_of(os.getpid())
    real.wait_ready(timeout=60)
    assert sorted(real.nodes()) == sorted(real.node_names)
    # etcd answers on the control plane's loopback only: compact_etcd dials it from there.
    assert real.cluster.compact_etcd() > 0


def test_down_leaves_nothing_and_the_host_network_unchanged(
    real: RealCluster, before: dict[str, Any]
) -> None:
    prefix, state_dir = real.prefix, real.cluster.state_dir
    assert real.down() == []
    assert netns.leftovers(prefix) == []
    assert cgroups.leftovers(prefix) == []
    assert processes_mentioning(str(state_dir), prefix) == []
    assert not state_dir.exists()
    assert host_mounts(state_dir) == before["mounts"]
    after = host_network_state()
    for key, value in before["network"].items():
        assert after[key] == value, f"the host's {key} changed"
