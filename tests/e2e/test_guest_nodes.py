"""Real kubelet nodes in the proxy-vm guest (`RealCluster(vm=...)`, docs/real-kubelets.md
"Nodes in the IPVS guest"): the nodes of the ipvs conformance run.

Two nodes run in one guest (its kernel has IPVS), each the guest NIC on a tap device of the
host's fabric; the control plane stays on the host. Both Nodes become Ready with the guest's
kernel, a busybox pod runs on each with an address of its node's pod CIDR, the pods reach each
other across the nodes over both families (through `kubectl exec`: the apiserver dials the
guest's kubelets over the fabric), the control plane's netns reaches a pod in the guest, and
`down` leaves no guest, scratch disk, netns, link or state directory, with the host's routes and
ruleset as they were.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_real_kubelets import host_network_state

from kpx_cluster import netns
from kpx_cluster.controlplane import DEFAULT_ROOT
from kpx_cluster.kubelets.cluster import GUEST_SCRATCH_GB, RealCluster
from kpx_cluster.kubelets.static_images import BUSYBOX_IMAGE
from kpx_cluster.vm import image as vm_image
from kpx_cluster.vm.machine import Guest

# The harness waits up to 12 min for a guest node (under emulation) and then says why; the
# default per-test timeout would cut that short.
# about 4-5 min (two guest boots under emulation): `make test-long`, not `make test`;
# `make conformance-ipvs` stands on the same nodes
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.long,
    pytest.mark.timeout(1200),
]


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in out.stdout.splitlines())


@pytest.fixture(scope="module")
def before() -> dict[str, Any]:
    if vm_image.missing_host_tools():
        pytest.fail(f"missing {vm_image.missing_host_tools()}: run `make setup-vm`")
    return {"network": host_network_state(), "links": _links(), "netns": netns.leftovers()}


@pytest.fixture(scope="module")
def guest_cluster(before: dict[str, Any]) -> Iterator[RealCluster]:
    rc = RealCluster(f"guest-{os.getpid()}", nodes=2, dns=False, vm=f"gn{os.getpid()}")
    started = time.monotonic()
    rc.up()
    print(f"guest nodes up in {time.monotonic() - started:.0f}s")
    try:
        yield rc
    finally:
        rc.down()


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "c", "image": BUSYBOX_IMAGE, "command": ["sleep", "3600"]}],
        },
    }


@pytest.fixture(scope="module")
def pods(guest_cluster: RealCluster) -> dict[str, dict[str, Any]]:
    rc = guest_cluster
    items = [_pod(f"bb-{n}", n) for n in rc.node_names]
    rc.cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    rc.cluster.kubectl(
        "wait", "--for=condition=Ready", "pod", "--all", "--timeout=300s", timeout=310
    )
    got = json.loads(rc.cluster.kubectl("get", "pods", "-o", "json").stdout)["items"]
    return {p["spec"]["nodeName"]: p for p in got}


def _guest_kernel(rc: RealCluster) -> str:
    out: list[bytes] = []
    code = Guest(rc.vm or "").exec(["uname", "-r"], on_output=lambda _c, data: out.append(data))
    assert code == 0
    return b"".join(out).decode().strip()


def test_guest_nodes_are_ready_on_the_guests_kernel(guest_cluster: RealCluster) -> None:
    nodes = guest_cluster.nodes()
    kernel = _guest_kernel(guest_cluster)
    assert kernel != os.uname().release  # the guest's Debian kernel: the host's has no IPVS
    for name in guest_cluster.node_names:
        node = nodes[name]
        assert RealCluster.is_ready(node)
        assert node["status"]["nodeInfo"]["kernelVersion"] == kernel
        addresses = {a["address"] for a in node["status"]["addresses"]}
        plan = guest_cluster.plans[name]
        assert {plan.ipv4, plan.ipv6} <= addresses


def test_a_pod_runs_on_each_guest_node_in_its_pod_cidrs(
    guest_cluster: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    for name in guest_cluster.node_names:
        plan = guest_cluster.plans[name]
        ips = [ipaddress.ip_address(p["ip"]) for p in pods[name]["status"]["podIPs"]]
        assert any(ip in ipaddress.ip_network(plan.pod_cidr_v4) for ip in ips), ips
        assert any(ip in ipaddress.ip_network(plan.pod_cidr_v6) for ip in ips), ips


def test_pods_reach_each_other_across_the_guests_nodes(
    guest_cluster: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    first, second = guest_cluster.node_names
    for target in pods[second]["status"]["podIPs"]:
        done = guest_cluster.cluster.kubectl(
            "exec", f"bb-{first}", "--", "ping", "-c", "1", "-W", "5", target["ip"], check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_control_planes_netns_reaches_a_pod_in_the_guest(
    guest_cluster: RealCluster, pods: dict[str, dict[str, Any]]
) -> None:
    assert guest_cluster.cluster.netns is not None
    target = pods[guest_cluster.node_names[0]]["status"]["podIP"]
    proxied = guest_cluster.cluster.kubectl(
        "get", "--raw", f"/api/v1/namespaces/default/pods/bb-{guest_cluster.node_names[0]}"
    )
    assert json.loads(proxied.stdout)["status"]["podIP"] == target
    logs = guest_cluster.cluster.kubectl("logs", f"bb-{guest_cluster.node_names[0]}", check=False)
    assert logs.returncode == 0, logs.stderr  # the apiserver reached the guest's kubelet


def test_down_leaves_no_guest_disk_netns_or_link_and_the_host_network_unchanged(
    guest_cluster: RealCluster, pods: dict[str, dict[str, Any]], before: dict[str, Any]
) -> None:
    assert pods  # the cluster ran pods
    guest = Guest(guest_cluster.vm or "")
    assert guest.pid() is not None
    # the nodes' image disk, cached, the most recently used (the guest wrote to an overlay)
    disks = sorted(vm_image.vm_cache().glob("images-*.img"), key=lambda p: p.stat().st_mtime)
    assert disks
    assert disks[-1].stat().st_size == GUEST_SCRATCH_GB << 30
    used = (disks[-1], disks[-1].stat().st_mtime_ns)
    left = guest_cluster.down()
    assert left == []
    assert guest.pid() is None
    assert not guest.scratch.exists()
    assert not guest.state_dir.exists()
    assert used[0].stat().st_mtime_ns == used[1]  # kept, unchanged
    assert not (DEFAULT_ROOT / guest_cluster.name).exists()
    assert netns.leftovers() == before["netns"]
    assert _links() == before["links"]
    assert host_network_state() == before["network"]
