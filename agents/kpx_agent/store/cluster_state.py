"""What the agent knows of the cluster, and which Services changed since the last sync.

Watch handlers only record here (like kube-proxy's change trackers); the sync loop takes the
changes out and computes. Plain data structures: unit tests drive them directly.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..model.service_ports import SERVICE_NAME_LABEL
from . import compact
from .compact import TRIGGER_ANNOTATION

Obj = Mapping[str, Any]
Key = tuple[str, str]  # (namespace, name)

SERVICES, SLICES, NAMESPACES, NODES = "services", "endpointslices", "namespaces", "nodes"


def _key(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _owner(slice_obj: Obj) -> Key | None:
    meta = slice_obj.get("metadata") or {}
    svc = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return (str(meta.get("namespace", "")), str(svc)) if svc else None


def _trigger_time(slice_obj: Obj) -> float | None:
    value = ((slice_obj.get("metadata") or {}).get("annotations") or {}).get(TRIGGER_ANNOTATION)
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Changes:
    """What to recompute: these Services (or all of them), with their change trigger times."""

    services: set[Key] = field(default_factory=set)
    everything: bool = False
    node: bool = False  # this node's object changed: the proxier decides what that affects
    trigger_times: dict[Key, float] = field(default_factory=dict)
    queued_at: float = 0.0

    def __bool__(self) -> bool:
        return self.everything or self.node or bool(self.services)


class ClusterState:
    """Services, EndpointSlices, Namespaces and this node, as last seen, plus pending changes."""

    def __init__(self) -> None:
        self.services: dict[Key, Obj] = {}
        self.slices: dict[Key, Obj] = {}
        self.slices_by_service: dict[Key, set[Key]] = defaultdict(set)
        self.namespaces: dict[str, Mapping[str, str]] = {}
        self.node: Obj | None = None
        self.synced: set[str] = set()
        self._changes = Changes()
        # Called for every change recorded (the agent's health and last-queued metric).
        self.on_queued: Callable[[], None] | None = None
        # Upstream's change trackers' counts (metrics): every Service and EndpointSlice event
        # handed to the store (as upstream's OnServiceUpdate/OnEndpointSliceUpdate count them),
        # and the Services with a recorded change of each kind not yet taken by a sync.
        self.service_events = 0
        self.slice_events = 0
        self.services_pending: set[Key] = set()
        self.slices_pending: set[Key] = set()
        # EndpointSlice trigger times at or before this (epoch seconds) are of changes made
        # before the agent watched: not a programming latency of this agent's, so not
        # recorded (upstream's trackerStartTime; a cold start lists them all).
        self.started = time.time()

    # -- recording -----------------------------------------------------------------------------
    def shrink(self, kind: str, obj: dict[str, Any]) -> Obj:
        """What the store keeps of an object of `kind` (compact.py for Services and
        EndpointSlices): a reflector applies it as each object arrives, so a list never holds
        more than its kept form. An object equal to the one stored is the stored one: a
        relist holds the new list beside the store without a second copy of what did not
        change."""
        if kind == SERVICES:
            new, current = compact.service(obj), self.services
        elif kind == SLICES:
            new, current = compact.endpoint_slice(obj), self.slices
        else:
            return obj
        if not current:  # the first list: nothing to share (and no key to make)
            return new
        old = current.get(_key(new))
        return old if old is not None and old == new else new

    def _queue(self) -> None:
        if not self._changes:
            self._changes.queued_at = time.time()
        if self.on_queued is not None:
            self.on_queued()

    def _touch(self, svc: Key) -> None:
        self._queue()
        self._changes.services.add(svc)

    def touch_all(self) -> None:
        self._queue()
        self._changes.everything = True

    def _set_node(self, node: Obj | None) -> None:
        """Record this node's object; an identical one (a re-list) records nothing."""
        if node != self.node:
            self.node = node
            self._queue()
            self._changes.node = True

    def upsert(self, kind: str, obj: Obj) -> None:
        """Record an object as it is now. Services and EndpointSlices are kept with only the
        fields the agent reads (compact.py): an update of anything else records nothing."""
        if kind == SERVICES:
            self.service_events += 1
            key = _key(obj)
            svc = compact.service(obj)
            if self.services.get(key) != svc:
                self.services[key] = svc
                self._touch(key)
                self.services_pending.add(key)
        elif kind == SLICES:
            self.slice_events += 1
            self._upsert_slice(compact.endpoint_slice(obj))
        elif kind == NAMESPACES:
            self.namespaces[_key(obj)[1]] = dict((obj.get("metadata") or {}).get("labels") or {})
        elif kind == NODES:
            self._set_node(obj)

    def _upsert_slice(self, obj: Obj) -> None:
        key = _key(obj)
        old = self.slices.get(key)
        if old == obj:
            return
        if old is not None and (old_owner := _owner(old)) is not None:
            self.slices_by_service[old_owner].discard(key)
            self._touch(old_owner)
            self.slices_pending.add(old_owner)
        self.slices[key] = obj
        owner = _owner(obj)
        if owner is not None:
            self.slices_by_service[owner].add(key)
            self._touch(owner)
            self.slices_pending.add(owner)
            trigger = _trigger_time(obj)
            if trigger is not None and trigger > self.started:
                prev = self._changes.trigger_times.get(owner)
                self._changes.trigger_times[owner] = min(prev, trigger) if prev else trigger

    def delete(self, kind: str, obj: Obj) -> None:
        key = _key(obj)
        if kind == SERVICES:
            self.service_events += 1
            if self.services.pop(key, None) is not None:
                self._touch(key)
                self.services_pending.add(key)
        elif kind == SLICES:
            self.slice_events += 1
            old = self.slices.pop(key, None)
            if old is not None and (owner := _owner(old)) is not None:
                # A deleted slice's trigger time is its last update's, not the deletion's:
                # the Service's recorded one goes (as upstream's tracker drops it).
                self._changes.trigger_times.pop(owner, None)
                self.slices_by_service[owner].discard(key)
                if not self.slices_by_service[owner]:
                    del self.slices_by_service[owner]
                self._touch(owner)
                self.slices_pending.add(owner)
        elif kind == NAMESPACES:
            self.namespaces.pop(key[1], None)
        elif kind == NODES:
            self._set_node(None)

    def forget_namespaces(self, kind: str, namespaces: Iterable[str]) -> None:
        """Drop the Services or EndpointSlices of these namespaces (opted out: the watches do
        not send them any more, and the model leaves them out)."""
        gone = set(namespaces)
        current = self.services if kind == SERVICES else self.slices if kind == SLICES else {}
        for key in [k for k in current if k[0] in gone]:
            self.delete(kind, current[key])

    def replace(self, kind: str, objs: Iterable[Obj]) -> None:
        """A full list arrived: make the store equal to it, recording only real differences."""
        objs = list(objs)
        if kind == NODES:
            self._set_node(objs[0] if objs else None)
        elif kind == NAMESPACES:
            self.namespaces = {
                _key(o)[1]: dict((o.get("metadata") or {}).get("labels") or {}) for o in objs
            }
        else:
            new = {_key(o): o for o in objs}
            current = self.services if kind == SERVICES else self.slices
            for key in [k for k in current if k not in new]:
                self.delete(kind, current[key])
            for obj in new.values():
                self.upsert(kind, obj)
        self.synced.add(kind)

    # -- reading -------------------------------------------------------------------------------
    def slices_of(self, svc: Key) -> list[Obj]:
        return [self.slices[k] for k in self.slices_by_service.get(svc, ()) if k in self.slices]

    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        self.services_pending.clear()
        self.slices_pending.clear()
        return changes

    def has_changes(self) -> bool:
        return bool(self._changes)
