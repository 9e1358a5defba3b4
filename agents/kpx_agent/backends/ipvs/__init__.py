"""ipvs mode (deprecated upstream: prefer nftables): see README.md beside this file."""

from __future__ import annotations

from ...model.types import DataplaneSettings
from ..base import Handover, NodePaths
from .backend import IpvsBackend, cleanup
from .kernel import NodeKernel
from .leftover_removal import remove_kpx_ipvs_leftovers


def create(settings: DataplaneSettings, paths: NodePaths | None = None) -> IpvsBackend:
    """`paths.ipv4_sysctls`: where the node's net.ipv4 sysctls are (default: the agent's own
    /proc/sys/net/ipv4, read-only in a pod)."""
    return IpvsBackend(settings, NodeKernel(paths.ipv4_sysctls if paths else None))


def remove_leftovers(handover: Handover) -> None:
    """What a kpx ipvs agent left, for an agent of another mode: its virtual servers,
    kube-ipvs0 and helper tables, never upstream kube-proxy's (leftovers.py); the removing
    agent's excludeCIDRs stay. Its full `cleanup` would take every virtual server."""
    remove_kpx_ipvs_leftovers(
        handover.settings.ipvs.exclude_cidrs, handover.kube_proxy_ipvs_mode_here
    )


__all__ = ["IpvsBackend", "cleanup", "create", "remove_leftovers"]
