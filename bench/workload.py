"""The one workload of the kpx benchmarks: N ClusterIP Services (one TCP port 80 -> 8080) and N
EndpointSlices of 10 ready endpoints (made-up pod IPs in 10.244.0.0/16, nodeName spread over 4
nodes), in one namespace, and the Node `bench-node-0` with an InternalIP (kube-proxy waits 30 s
for a node IP without one).

Two forms of it: in the apiserver (bench/compare.py: grown in bulk over HTTPS, changed one
endpoint at a time), and in-process as the node-local state the agent on `bench-node-0` derives
from it (`node_local_state`: bench/floors.py, bench/state_api.py, bench/ipvs_in_vm.py), with
the cluster IPs of `service_vip` instead of the apiserver's allocation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from ipaddress import ip_network
from typing import Any

from benchlib import (
    ApiClient,
    component_pid,
    endpoint_slice,
    endpoints,
    log,
    namespace,
    proc_cpu_seconds,
    service,
    services_path,
    slices_path,
)
from kpx_agent.model.service_ports import node_facts
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)
from kpx_cluster.controlplane import Cluster
from ruleset_readback import Key, Mappings

NAMESPACE = "bench"
NODE_NAMES = tuple(f"bench-node-{i}" for i in range(4))
NODE_NAME = NODE_NAMES[0]  # the node whose agent is measured
NODE_IP = "10.242.0.1"  # the fabric address of a Topology's first node
ENDPOINTS_PER_SERVICE = 10
SERVICE_PORT = 80
TARGET_PORT = 8080
CLUSTER_CIDR = "10.244.0.0/16"
CREATE_CHUNK = 1000
NODE_SETTLE_SECONDS = 8.0
"""After the Node is created: the controller-manager's node controllers settle first."""
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager")


def svc_name(i: int) -> str:
    return f"svc-{i:05d}"


def endpoint_addresses(svc: int) -> list[tuple[str, str]]:
    """10 (address, nodeName) pairs; endpoint j's third octet is in [20j, 20j+19]."""
    return [
        (
            f"10.244.{j * 20 + (svc // 250) % 20}.{svc % 250 + 1}",
            NODE_NAMES[(svc + j) % len(NODE_NAMES)],
        )
        for j in range(ENDPOINTS_PER_SERVICE)
    ]


#: Replacement addresses: 10.244.200.1-10.244.255.250, a range no original endpoint uses.
CHANGED_ADDRESSES = 56 * 250


def changed_address(k: int) -> str:
    """Address of the k-th replacement endpoint (no original endpoint has it); after
    CHANGED_ADDRESSES of them the range starts over (a run of several systems, each with a
    sustained burst, hands out more: `Workload.replace_last` skips one its Service holds)."""
    k %= CHANGED_ADDRESSES
    return f"10.244.{200 + k // 250}.{k % 250 + 1}"


# ---- in-process: the node-local state of the measured node ---------------------------------------

#: The agent's settings for the workload (its cluster CIDR) and the measured node.
SETTINGS = DataplaneSettings(cluster_cidrs=(ip_network(CLUSTER_CIDR),))
NODE = NodeInfo(NODE_NAME, (IP.of(NODE_IP),))


def service_vip(svc: int) -> str:
    """Service svc's cluster IP in the in-process form (10.96.0.0/16, as the apiserver's)."""
    return f"10.96.{1 + svc // 250}.{svc % 250 + 1}"


def service_port(svc: int, target_port: int = TARGET_PORT) -> ServicePort:
    """Service svc's port as the node-local model hands it to a backend (the endpoints on
    NODE_NAME are local); `target_port` other than TARGET_PORT changes every endpoint."""
    key = ServicePortKey(NAMESPACE, svc_name(svc), "http", Protocol.TCP, 4)
    eps = tuple(
        Endpoint(IP.of(ip), target_port, node == NODE_NAME) for ip, node in endpoint_addresses(svc)
    )
    return ServicePort(
        key,
        SERVICE_PORT,
        cluster_ips=(IP.of(service_vip(svc)),),
        cluster_endpoints=eps,
        external_endpoints=eps,
    )


def node_local_state(n: int, settings: DataplaneSettings = SETTINGS) -> NodeLocalState:
    """The first n Services of the workload as NODE's node-local state."""
    ports = (service_port(i) for i in range(n))
    return NodeLocalState(NODE, {p.key: p for p in ports}, node_facts(settings, NODE))


# ---- in the apiserver ----------------------------------------------------------------------------


def control_plane_cpu(cluster: Cluster) -> dict[str, float]:
    pids = {name: component_pid(cluster, name) for name in CONTROL_PLANE}
    return {name: proc_cpu_seconds(pid)[0] for name, pid in pids.items() if pid}


@dataclass
class Workload:
    """What the apiserver holds: every Service's VIP and its current endpoints."""

    vips: list[str] = field(default_factory=list)
    current: list[list[tuple[str, str]]] = field(default_factory=list)
    replaced: int = 0  # replacement addresses handed out
    creation: list[dict[str, Any]] = field(default_factory=list)
    node_created: float = 0.0  # monotonic clock
    namespace: str = NAMESPACE  # where its Services and EndpointSlices are

    @property
    def size(self) -> int:
        return len(self.vips)

    def key(self, svc: int) -> Key:
        return (self.vips[svc], "tcp", SERVICE_PORT)

    def expected(self, n: int | None = None) -> Mappings:
        return {
            self.key(i): frozenset(f"{ip}:{TARGET_PORT}" for ip, _ in self.current[i])
            for i in range(self.size if n is None else n)
        }

    def replace_last(self, svc: int) -> tuple[str, str, tuple[str, dict[str, Any]]]:
        """Replace svc's last endpoint: (old 'IP:PORT', new 'IP:PORT', the PATCH to send)."""
        addrs = self.current[svc]
        old = addrs[-1][0]
        held = {ip for ip, _ in addrs}
        new = changed_address(self.replaced)
        self.replaced += 1
        while new in held:  # (the range started over)
            new = changed_address(self.replaced)
            self.replaced += 1
        addrs[-1] = (new, addrs[-1][1])
        patch = (slices_path(self.namespace, f"{svc_name(svc)}-1"), {"endpoints": endpoints(addrs)})
        return f"{old}:{TARGET_PORT}", f"{new}:{TARGET_PORT}", patch

    def settle_node(self) -> None:
        """Sleep until NODE_SETTLE_SECONDS after the Node was created."""
        time.sleep(max(0.0, self.node_created + NODE_SETTLE_SECONDS - time.monotonic()))


def create_node(api: ApiClient, work: Workload) -> None:
    """The namespace and the measured node's Node, with its InternalIP."""
    api.create("/api/v1/namespaces", namespace(NAMESPACE))
    api.create(
        "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME}}
    )
    api.request(
        "PATCH",
        f"/api/v1/nodes/{NODE_NAME}/status",
        {"status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]}},
        "merge",
    )
    work.node_created = time.monotonic()


def grow(cluster: Cluster, api: ApiClient, work: Workload, n: int) -> None:
    """Create Services and EndpointSlices size..n-1; what it took goes to work.creation."""
    start = work.size
    if n <= start:
        return
    cpu0 = control_plane_cpu(cluster)
    t0 = time.monotonic()
    chunks_s: list[float] = []
    for lo in range(start, n, CREATE_CHUNK):
        chunk = range(lo, min(n, lo + CREATE_CHUNK))
        c0 = time.monotonic()
        ns = work.namespace
        made = api.many("POST", [(services_path(ns), service(ns, svc_name(i))) for i in chunk])
        chunks_s.append(round(time.monotonic() - c0, 2))
        work.vips += [str(obj["spec"]["clusterIP"]) for obj in made]
        log(f"  services: {work.size}/{n}")
    services_s = time.monotonic() - t0
    t1 = time.monotonic()
    for lo in range(start, n, CREATE_CHUNK):
        chunk = range(lo, min(n, lo + CREATE_CHUNK))
        addrs = [endpoint_addresses(i) for i in chunk]
        api.many(
            "POST",
            [
                (
                    slices_path(work.namespace),
                    endpoint_slice(work.namespace, svc_name(i), a, TARGET_PORT),
                )
                for i, a in zip(chunk, addrs, strict=True)
            ],
        )
        work.current += addrs
        log(f"  endpointslices: {chunk.stop}/{n}")
    cpu1 = control_plane_cpu(cluster)
    work.creation.append(
        {
            "from": start,
            "to": n,
            "services_s": round(services_s, 2),
            "service_chunks_s": chunks_s,
            "slices_s": round(time.monotonic() - t1, 2),
            "control_plane_cpu_s": {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1},
        }
    )
