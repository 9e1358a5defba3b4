"""Dataplane backends. Each mode is a package of its own; none imports another.

The registry maps a mode name to the module that provides it; the module is imported only when
that mode is selected, so an agent in one mode never loads another mode's code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Backend

# mode -> module exposing `create(settings) -> Backend` and `cleanup() -> None`
REGISTRY: dict[str, str] = {
    "nftables": "kpx_agent.backends.nftables",
    "iptables": "kpx_agent.backends.iptables",
    "ipvs": "kpx_agent.backends.ipvs",
    # state-server-only (kpx_api.STATE_SERVER_ONLY_MODES): no kernel rules
    "external": "kpx_agent.backends.state_only",
}


def load(mode: str) -> object:
    """The backend module for `mode` (raises KeyError naming the known modes)."""
    try:
        module = REGISTRY[mode]
    except KeyError:
        raise KeyError(f"unknown mode {mode!r}; known: {', '.join(sorted(REGISTRY))}") from None
    return importlib.import_module(module)


__all__ = ["REGISTRY", "Backend", "load"]
