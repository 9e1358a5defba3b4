"""Mode external: the agent's state-server-only mode. No kernel rules: every sync only hands
the node-local state to the state API (kpx_agent.state_api), from which the user's backend
(a sidecar) programs the dataplane."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..model.types import DataplaneSettings, NodeLocalState, ServicePortKey
from .base import Backend, Handover, NodePaths


@dataclass
class StateOnlyBackend(Backend):
    settings: DataplaneSettings
    mode: str = "external"

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        """Nothing to program: the proxier's on_synced hook publishes the state."""

    def cleanup(self) -> None:
        """Nothing was programmed."""


def create(settings: DataplaneSettings, paths: NodePaths | None = None) -> StateOnlyBackend:
    return StateOnlyBackend(settings)


def cleanup() -> None:
    """Nothing to remove: the external backend cleans up what it programmed."""


def remove_leftovers(handover: Handover) -> None:
    """Nothing to remove: an external backend's rules are its own to remove."""
    del handover
