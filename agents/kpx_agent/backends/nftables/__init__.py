"""nftables mode: see README.md beside this file for the tables, hooks and priorities."""

from __future__ import annotations

from ...localnet import ProxySettings
from ..base import NodePaths
from .backend import NftablesBackend, cleanup


def create(settings: ProxySettings, paths: NodePaths | None = None) -> NftablesBackend:
    """`paths`: accepted for the common signature; nftables mode writes no node file."""
    del paths
    return NftablesBackend(settings)


__all__ = ["NftablesBackend", "cleanup", "create"]
