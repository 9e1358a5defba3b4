"""The fields of a Service or an EndpointSlice the agent reads, and nothing else.

The store (cluster_state.py) keeps every Service and EndpointSlice of the cluster for as long as
the agent runs: whole objects (managedFields, annotations such as kubectl's
last-applied-configuration, selectors, endpoints' targetRefs) cost memory at every node and
make every update look like a change. What the node-local model and the agent read is listed
here, once; a field read elsewhere must be added here (tests/unit/test_compact.py runs the
node-local model's table through it, so a field missing here fails it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from .node_local import SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL, TOPOLOGY_MODE_ANNOTATIONS

Obj = Mapping[str, Any]

#: The annotation an EndpointSlice carries with the time of the change that made it
#: (kubeproxy_network_programming_duration_seconds).
TRIGGER_ANNOTATION: Final = "endpoints.kubernetes.io/last-change-trigger-time"

_META: Final = ("name", "namespace", "creationTimestamp")
_SERVICE_LABELS: Final = (SERVICE_PROXY_NAME_LABEL,)
_SERVICE_ANNOTATIONS: Final = TOPOLOGY_MODE_ANNOTATIONS
#: spec fields no part of the agent reads (the selector is the endpoints controller's).
_SERVICE_SPEC_UNREAD: Final = frozenset({"selector", "publishNotReadyAddresses"})
_SLICE_LABELS: Final = (SERVICE_NAME_LABEL,)
_SLICE_ANNOTATIONS: Final = (TRIGGER_ANNOTATION,)
_ENDPOINT: Final = ("addresses", "conditions", "hints", "nodeName", "zone")


def _pick(source: object, keys: Iterable[str]) -> dict[str, Any]:
    if not isinstance(source, Mapping):
        return {}
    return {k: source[k] for k in keys if k in source}


def _metadata(obj: Obj, labels: Iterable[str], annotations: Iterable[str]) -> dict[str, Any]:
    meta = obj.get("metadata")
    out = _pick(meta, _META)
    if isinstance(meta, Mapping):
        if picked := _pick(meta.get("labels"), labels):
            out["labels"] = picked
        if picked := _pick(meta.get("annotations"), annotations):
            out["annotations"] = picked
    return out


def service(obj: Obj) -> dict[str, Any]:
    """A Service with only what the agent reads: identity, creation time, the proxy-name
    label, the topology annotations, the spec (but its selector) and status.loadBalancer."""
    out: dict[str, Any] = {"metadata": _metadata(obj, _SERVICE_LABELS, _SERVICE_ANNOTATIONS)}
    spec = obj.get("spec")
    if isinstance(spec, Mapping):
        out["spec"] = {k: v for k, v in spec.items() if k not in _SERVICE_SPEC_UNREAD}
    status = obj.get("status")
    if isinstance(status, Mapping) and status.get("loadBalancer"):
        out["status"] = {"loadBalancer": status["loadBalancer"]}
    return out


def endpoint_slice(obj: Obj) -> dict[str, Any]:
    """An EndpointSlice with only what the agent reads: identity, its Service's name, the
    change-trigger time, the address type, ports and each endpoint's addresses, conditions,
    hints, node and zone (not its targetRef)."""
    out: dict[str, Any] = {"metadata": _metadata(obj, _SLICE_LABELS, _SLICE_ANNOTATIONS)}
    out.update(_pick(obj, ("addressType", "ports")))
    endpoints = obj.get("endpoints")
    if isinstance(endpoints, list):
        out["endpoints"] = [_pick(ep, _ENDPOINT) if isinstance(ep, Mapping) else ep
                            for ep in endpoints]  # fmt: skip
    return out
