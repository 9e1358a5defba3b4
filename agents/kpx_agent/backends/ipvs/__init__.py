"""ipvs mode (deprecated upstream: prefer nftables): see README.md beside this file."""

from __future__ import annotations

from ...localnet import ProxySettings
from ..base import NodePaths
from .backend import IpvsBackend, cleanup


def create(settings: ProxySettings, paths: NodePaths | None = None) -> IpvsBackend:
    """`paths`: accepted for the common signature; ipvs mode writes no node file there."""
    del paths
    return IpvsBackend(settings)


__all__ = ["IpvsBackend", "cleanup", "create"]
