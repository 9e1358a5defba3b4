"""iptables mode: see README.md beside this file for the tables, chains and hooks."""

from __future__ import annotations

from ...model.types import DataplaneSettings
from ..base import Handover, NodePaths
from .backend import IptablesBackend, cleanup


def create(settings: DataplaneSettings, paths: NodePaths | None = None) -> IptablesBackend:
    if paths is None or paths.route_localnet is None:
        return IptablesBackend(settings)
    return IptablesBackend(settings, route_localnet_file=paths.route_localnet)


def remove_leftovers(handover: Handover) -> None:
    """What a iptables agent left, for an agent of another mode: every iptables rule of kpx."""
    del handover
    cleanup()


__all__ = ["IptablesBackend", "cleanup", "create", "remove_leftovers"]
