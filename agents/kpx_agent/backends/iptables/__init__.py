"""iptables mode: see README.md beside this file for the tables, chains and hooks."""

from __future__ import annotations

from ...localnet import ProxySettings
from .backend import IptablesBackend, cleanup


def create(settings: ProxySettings) -> IptablesBackend:
    return IptablesBackend(settings)


__all__ = ["IptablesBackend", "cleanup", "create"]
