"""spec.takeover: taking nodes over from another proxy (upstream kube-proxy)."""

from __future__ import annotations

from pydantic import Field

from kpx_api.validation import KpxModel


class Takeover(KpxModel):
    """What the agents take over from upstream kube-proxy on their nodes."""

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
