"""nftables mode: see README.md beside this file for the tables, hooks and priorities."""

from __future__ import annotations

from ...localnet import ProxySettings
from .backend import NftablesBackend, cleanup


def create(settings: ProxySettings) -> NftablesBackend:
    return NftablesBackend(settings)


__all__ = ["NftablesBackend", "cleanup", "create"]
