"""spec.takeover: taking nodes over from another proxy (upstream kube-proxy), and what the
status says about it."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final

from pydantic import Field

from kpx_api.names import DNSSubdomain
from kpx_api.validation import KpxModel, Rule, Text

#: The label the operator puts on a node whose agent has its rules in (spec.takeover.
#: moveKubeProxyOff); the kube-proxy DaemonSet's affinity excludes nodes carrying it.
KUBE_PROXY_OFF_LABEL: Final = "proxy.kpx.dev/kube-proxy-replaced"


class Takeover(KpxModel):
    """What the agents take over from upstream kube-proxy on their nodes."""

    __rules__ = (
        Rule(
            cel="!has(self.moveKubeProxyOff) || !self.moveKubeProxyOff || "
            "(has(self.fromKubeProxy) && self.fromKubeProxy)",
            message="moveKubeProxyOff needs fromKubeProxy: true (kube-proxy's rules must be "
            "removed from the nodes it leaves)",
            check=lambda t: not t.move_kube_proxy_off or t.from_kube_proxy,
            field_path=".moveKubeProxyOff",
        ),
    )

    from_kube_proxy: bool = Field(
        default=False,
        strict=True,
        description="Remove upstream kube-proxy's rules from each node: its KUBE-* iptables "
        "chains and the jumps into them (nat, filter, mangle; IPv4 and IPv6; nf_tables and "
        "legacy iptables), its ip/ip6 kube-proxy nftables tables, and (modes other than ipvs) "
        "its IPVS virtual servers and kube-ipvs0. On each node the agent does it after its own "
        "first sync is programmed and verified, and only once no Pod of the "
        "kube-system/kube-proxy DaemonSet runs on that node (until then it waits, and "
        "reports WaitingForKubeProxy). Other KUBE-* chains (the kubelet's) and every other "
        "rule stay. false: kube-proxy's rules are left alone.",
    )
    move_kube_proxy_off: bool = Field(
        default=False,
        strict=True,
        description="The operator keeps the kube-system/kube-proxy DaemonSet off the nodes "
        "where kpx is ready, node by node: once a node's agent reports its first verified "
        f"sync, the operator labels the node {KUBE_PROXY_OFF_LABEL}=true, and (once) adds to "
        "the DaemonSet's pod template a required node affinity excluding nodes with that "
        "label (so the DaemonSet controller removes kube-proxy's Pod from each labelled node "
        "and the agent there then removes kube-proxy's rules). Needs fromKubeProxy. When the "
        "ProxyConfiguration is deleted the operator removes its labels (kube-proxy comes "
        "back); it never removes the affinity (docs/migrating.md). false: the operator "
        "touches neither kube-proxy's DaemonSet nor the nodes.",
    )


class TakeoverPhase(StrEnum):
    """Where a node is in the takeover from kube-proxy (from its agent's ProxyNodeState)."""

    AGENT_NOT_READY = "AgentNotReady"  # its agent has not verified its first sync yet
    AGENT_READY = "AgentReady"  # it has: kpx serves the node
    WAITING_FOR_KUBE_PROXY = "WaitingForKubeProxy"  # kube-proxy's Pod is still on the node
    REMOVAL_FAILING = "KubeProxyRulesNotRemoved"  # removing kube-proxy's rules fails (retried)
    KUBE_PROXY_RULES_REMOVED = "KubeProxyRulesRemoved"  # done


class TakeoverNode(KpxModel):
    """One node's takeover progress."""

    name: DNSSubdomain = Field(description="The node.")
    phase: TakeoverPhase = Field(
        description="AgentNotReady, AgentReady, WaitingForKubeProxy, "
        "KubeProxyRulesNotRemoved or KubeProxyRulesRemoved."
    )
    kube_proxy_off: bool = Field(
        default=False,
        strict=True,
        description=f"The node carries {KUBE_PROXY_OFF_LABEL} (spec.takeover."
        "moveKubeProxyOff): the kube-proxy DaemonSet leaves it.",
    )
    message: Annotated[str, Text(max_length=1024, message="")] = Field(
        default="", description="What the agent last said about it."
    )


class TakeoverStatus(KpxModel):
    """spec.takeover.fromKubeProxy: per-node progress and a summary."""

    nodes: Annotated[list[TakeoverNode], Field(max_length=5000)] = Field(
        default_factory=list,
        description="Each node with an agent of this configuration, by name.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    done: int = Field(
        default=0, ge=0, strict=True, description="Nodes where kube-proxy's rules are removed."
    )
    summary: Annotated[str, Text(max_length=1024, message="")] = Field(
        default="", description="How many nodes are in each phase."
    )
