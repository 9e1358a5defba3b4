"""The three-node network of the kernel tests that drive a backend in-process in node n1's netns
(test_semantics_matrix_kernel.py, test_traffic_origin_kernel.py).

n1 is the proxy node, n2 another node, n3 a host outside the cluster (a node netns with no pods
and no proxy). Pods: b1 (echo server named ``b1`` on TCP 8080, on n1's cbr0), b2 (the same as
``b2``, on n2), client (on n1's cbr0), rclient (on n1, a routed veth without bridge, as
bridgeless CNIs plumb pods) and far (on n2). n2 and n3 route the Service CIDRs
(10.96.0.0/16, fd00:96::/112) and the load-balancer range (192.0.2.0/24) via n1; n1 routes the
load-balancer range out on its fabric (its own packets need a route to reach the nat OUTPUT
hook at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from kpx_cluster.netns import Node, Pod, Topology

SERVICE_CIDR, SERVICE_CIDR_V6, LB_RANGE = "10.96.0.0/16", "fd00:96::/112", "192.0.2.0/24"


@dataclass
class ThreeNodes:
    topo: Topology
    n1: Node
    n2: Node
    n3: Node
    pods: dict[str, Pod]

    @classmethod
    def build(cls, topology: Topology) -> Self:
        n1, n2, n3 = (topology.add_node(name) for name in ("n1", "n2", "n3"))
        pods = {
            "b1": topology.add_pod(n1, "b1"),
            "b2": topology.add_pod(n2, "b2"),
            "client": topology.add_pod(n1, "client"),
            "rclient": topology.add_pod(n1, "rclient", routed=True),
            "far": topology.add_pod(n2, "far"),
        }
        for name in ("b1", "b2"):
            argv = topology.python_argv("kpx_cluster.echo_server", "--name", name, "--port", "8080")
            topology.run_ready(pods[name], argv)
        for node in (n2, n3):
            for cidr in (SERVICE_CIDR, LB_RANGE):
                topology.exec(node, ["ip", "route", "replace", cidr, "via", n1.ipv4], check=True)
            topology.exec(
                node, ["ip", "-6", "route", "replace", SERVICE_CIDR_V6, "via", n1.ipv6], check=True
            )
        topology.exec(n1, ["ip", "route", "replace", LB_RANGE, "dev", n1.fabric_if], check=True)
        return cls(topology, n1, n2, n3, pods)
