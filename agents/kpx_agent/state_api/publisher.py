"""Revisions of the node-local state, and the answer to each watch request (pure, no I/O).

`publish` runs where the proxier finishes a sync (a worker thread): it converts only the Service
ports that changed, keeps each one's serialized message, and makes a new revision only when
something differs. `answer` builds the response for one request from the current revision: a
delta when the client holds the one before, else the full state, serialized once per revision
and shared by every client (a client reading slowly only ever gets the latest; nothing is queued
per client).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from kpx_localstate_client import localstate_pb2 as pb

from ..model.types import (
    DataplaneSettings,
    NodeFacts,
    NodeInfo,
    NodeLocalState,
    ServicePort,
    ServicePortKey,
)
from .convert import facts_to_proto, key_to_proto, node_to_proto, port_to_proto, settings_to_proto

# WatchResponse field numbers (localstate.proto): the full state is assembled from each Service
# port's cached bytes rather than re-serialized (at 10,000 ports, ~50x cheaper).
_NODE, _SETTINGS, _PORTS, _DELETED, _FACTS = 4, 5, 6, 7, 8


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@dataclass(frozen=True)
class _Delta:
    """From revision - 1 to revision: the encoded service_ports and deleted fields."""

    revision: int
    body: bytes


class Publisher:
    """The node-local state as revisions of one agent instance."""

    def __init__(self, instance_id: str | None = None) -> None:
        self.instance_id = instance_id or uuid.uuid4().hex
        self.revision = 0  # 0: no full sync yet, nothing is answered
        self._lock = threading.Lock()
        # key -> (the port, its encoded `service_ports` field)
        self._ports: dict[ServicePortKey, tuple[ServicePort, bytes]] = {}
        self._node: tuple[NodeInfo | None, bytes] = (None, b"")
        self._settings: tuple[DataplaneSettings | None, bytes] = (None, b"")
        self._facts: tuple[dict[int, NodeFacts] | None, bytes] = (None, b"")
        self._delta: _Delta | None = None
        self._full: tuple[int, bytes] = (0, b"")  # (revision, encoded response)

    def publish(
        self,
        state: NodeLocalState,
        settings: DataplaneSettings,
        changed: Collection[ServicePortKey] | None,
    ) -> bool:
        """Take the state after a successful sync; `changed` as the backends get it (None: any
        port may have changed). True when this made a new revision."""
        with self._lock:
            keys = set(state.services) | set(self._ports) if changed is None else changed
            sets: dict[ServicePortKey, bytes] = {}
            deleted: list[ServicePortKey] = []
            for key in keys:
                port = state.services.get(key)
                held = self._ports.get(key)
                if port is None:
                    if held is not None:
                        del self._ports[key]
                        deleted.append(key)
                elif held is None or held[0] != port:
                    encoded = _field(_PORTS, port_to_proto(port).SerializeToString())
                    self._ports[key] = (port, encoded)
                    sets[key] = encoded
            node_changed = self._node[0] != state.node or (
                self._node[0] is not None and self._node[0].zone != state.node.zone
            )
            if node_changed:
                node_bytes = _field(_NODE, node_to_proto(state.node).SerializeToString())
                self._node = (state.node, node_bytes)
            if self._settings[0] != settings:
                encoded = _field(_SETTINGS, settings_to_proto(settings).SerializeToString())
                self._settings = (settings, encoded)
                node_changed = True
            if self._facts[0] != state.facts:
                facts = dict(state.facts)
                encoded = b"".join(
                    _field(_FACTS, facts_to_proto(facts[f]).SerializeToString())
                    for f in sorted(facts)
                )
                self._facts = (facts, encoded)
                node_changed = True
            if self.revision and not (sets or deleted or node_changed):
                return False
            self.revision += 1
            body = b"".join(sets[k] for k in sorted(sets)) + b"".join(
                _field(_DELETED, key_to_proto(k).SerializeToString()) for k in sorted(deleted)
            )
            self._delta = _Delta(self.revision, body)
            return True

    def ready(self, instance_id: str, revision: int) -> bool:
        """Whether a client holding (instance_id, revision) gets an answer now."""
        return self.revision > 0 and (instance_id != self.instance_id or revision != self.revision)

    def answer(self, instance_id: str, revision: int, want_deltas: bool) -> bytes:
        """The encoded WatchResponse for this request (call only when `ready`)."""
        with self._lock:
            header = pb.WatchResponse(instance_id=self.instance_id, revision=self.revision)
            delta = self._delta
            if (
                want_deltas
                and instance_id == self.instance_id
                and delta is not None
                and delta.revision == self.revision
                and revision == self.revision - 1
            ):
                return self._head(header) + delta.body
            if self._full[0] != self.revision:
                header.full = True
                ports = self._ports
                self._full = (
                    self.revision,
                    self._head(header) + b"".join(ports[k][1] for k in sorted(ports)),
                )
            return self._full[1]

    def _head(self, header: pb.WatchResponse) -> bytes:
        """What every response has: its header, the node, the settings and the node facts
        (fields may come in any order on the wire; these come first)."""
        return header.SerializeToString() + self._node[1] + self._settings[1] + self._facts[1]

    @property
    def port_count(self) -> int:
        return len(self._ports)
