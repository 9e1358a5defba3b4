"""Which traffic comes from this node's pods (detectLocal), decided once for every backend.

Backends use it in two places, as upstream kube-proxy does (pkg/proxy/util/localdetector.go):
traffic to a cluster IP that is *not* local is masqueraded (it may have come from outside the
cluster through a route to the Service CIDR), and traffic to an externalTrafficPolicy: Local
address that *is* local is sent to every cluster endpoint ("short circuit").

`local_pods(settings, node, family)` gives one family's match: source networks (ClusterCIDR:
the family's clusterCIDRs; NodeCIDR: the family's Node spec.podCIDRs) or an input interface
(BridgeInterface: that name; InterfaceNamePrefix: names starting with the prefix). A mode with
nothing to match in a family (ClusterCIDR without a clusterCIDR of that family, NodeCIDR before
the Node has a pod CIDR of that family) gives a match that is not `implemented`: as upstream's
no-op detector, no traffic counts as local then, so nothing is masqueraded as off-cluster and
nothing is short-circuited as coming from a pod (traffic from the node itself still is).
"""

from __future__ import annotations

from .types import NOTHING_LOCAL, DataplaneSettings, DetectLocalMode, LocalPods, NodeInfo

__all__ = ["NOTHING_LOCAL", "LocalPods", "local_pods"]


def local_pods(settings: DataplaneSettings, node: NodeInfo, family: int) -> LocalPods:
    """The match for traffic from this node's pods in `family` (4 or 6)."""
    detect = settings.detect_local
    if detect.mode is DetectLocalMode.CLUSTER_CIDR:
        nets = tuple(net for net in settings.cluster_cidrs if net.version == family)
    elif detect.mode is DetectLocalMode.NODE_CIDR:
        # A Node has at most one pod CIDR per family; upstream uses the first.
        nets = tuple(net for net in node.pod_cidrs if net.version == family)[:1]
    elif detect.mode is DetectLocalMode.BRIDGE_INTERFACE:
        return LocalPods(interface=detect.interface)
    else:
        return LocalPods(interface_prefix=detect.interface)
    return LocalPods(networks=nets) if nets else NOTHING_LOCAL
