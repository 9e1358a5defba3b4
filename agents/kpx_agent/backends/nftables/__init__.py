"""nftables mode: see README.md beside this file for the tables, hooks and priorities."""

from __future__ import annotations

from ...model.types import DataplaneSettings
from ..base import Handover, NodePaths
from .backend import NftablesBackend, cleanup


def create(settings: DataplaneSettings, paths: NodePaths | None = None) -> NftablesBackend:
    """`paths.route_localnet`: where the node's route_localnet is mounted (localhost
    NodePorts set it); None: this network namespace's own."""
    if paths is None or paths.route_localnet is None:
        return NftablesBackend(settings)
    return NftablesBackend(settings, route_localnet_file=paths.route_localnet)


def remove_leftovers(handover: Handover) -> None:
    """What a nftables agent left, for an agent of another mode: every nftables rule of kpx."""
    del handover
    cleanup()


__all__ = ["NftablesBackend", "cleanup", "create", "remove_leftovers"]
