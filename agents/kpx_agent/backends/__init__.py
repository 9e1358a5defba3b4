"""Dataplane backends. Each mode is a package of its own; none imports another.

The registry maps a mode name to the module that provides it, and `load` returns that module as
the one typed contract of a mode (`base.Mode`: create its backend, clean up, remove what an
agent of it left). The module is imported only when that mode is loaded: an agent in one mode
loads another mode's code only to remove that mode's leftovers (takeover.py), never to start.
Nothing outside a mode's package imports into it but this registry (tests/unit/
test_import_boundaries.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .base import Backend, Mode

if TYPE_CHECKING:
    # mypy checks that each mode's module is a Mode (nothing is imported at run time).
    from . import iptables, ipvs, nftables, state_only

    _CHECKED: tuple[Mode, ...] = (nftables, iptables, ipvs, state_only)

# mode -> module of that mode, a `base.Mode`
REGISTRY: dict[str, str] = {
    "nftables": "kpx_agent.backends.nftables",
    "iptables": "kpx_agent.backends.iptables",
    "ipvs": "kpx_agent.backends.ipvs",
    # state-server-only (kpx_api.STATE_SERVER_ONLY_MODES): no kernel rules
    "external": "kpx_agent.backends.state_only",
}


def load(mode: str) -> Mode:
    """The module of `mode` (raises KeyError naming the known modes, TypeError when the module
    lacks part of the Mode contract)."""
    try:
        name = REGISTRY[mode]
    except KeyError:
        raise KeyError(f"unknown mode {mode!r}; known: {', '.join(sorted(REGISTRY))}") from None
    module = importlib.import_module(name)
    if not isinstance(module, Mode):
        raise TypeError(
            f"{name} does not provide the Mode contract (create, cleanup, remove_leftovers)"
        )
    return module


__all__ = ["REGISTRY", "Backend", "Mode", "load"]
