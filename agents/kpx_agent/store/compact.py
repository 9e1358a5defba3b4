"""The fields of a Service or an EndpointSlice the agent reads, and nothing else.

The store (cluster_state.py) keeps every Service and EndpointSlice of the cluster for as long as
the agent runs: whole objects (managedFields, annotations such as kubectl's
last-applied-configuration, selectors, endpoints' targetRefs) cost memory at every node and
make every update look like a change. What the node-local model and the agent read is listed
here, once; a field read elsewhere must be added here (tests/unit/test_compact.py runs the
node-local model's table through it, so a field missing here fails it).

Memory: the compact form holds no container of the decoded original (values that many
objects repeat, such as an endpoint's conditions or a slice's ports, are one shared object;
names and other repeated strings are interned), so an item's decoded tree is freed once it is
compacted. Its strings are kept as they are: lists arrive item by item (kpx_kube.list_body),
so the few strings kept of each item sit among the next items' allocations, which reuse the
memory the item freed (copying them cost 0.1 s of CPU per 10,000 Services and saved nothing
measurable). The result is read, never changed: shared values must not be mutated. A compact
object compacts to itself.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import orjson

from ..model.service_ports import (
    SERVICE_NAME_LABEL,
    SERVICE_PROXY_NAME_LABEL,
    TOPOLOGY_MODE_ANNOTATIONS,
    EndpointFields,
)
from ..model.types import IP

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
_AF_INET: Final = socket.AF_INET
_pton = socket.inet_pton


class Compact(dict[str, Any]):
    """A Service or EndpointSlice in compact form (what `service` and `endpoint_slice` return)."""

    __slots__ = ()


#: Values shared between compact objects, by their canonical form; cleared when full, which
#: only costs sharing (the objects already made keep theirs).
_SHARED: dict[object, Any] = {}
_SHARED_MAX: Final = 50_000


def _text(value: str) -> str:
    """A string, interned (names, namespaces, node names, zones repeat): one object for every
    equal one. A subclass of str (never decoded JSON) is kept as it is."""
    return sys.intern(value) if type(value) is str else value


#: Dict keys already interned (`_key`): the API's field names, a handful that every object
#: repeats; cleared when full (a map with keys of its own, such as a selector, adds some).
_KEYS: dict[str, str] = {}
_KEYS_MAX: Final = 1_000


def _key(value: str) -> str:
    """`_text` for a dict key, from `_KEYS` once interned (no intern per object)."""
    found = _KEYS.get(value)
    if found is None:
        if len(_KEYS) >= _KEYS_MAX:
            _KEYS.clear()
        found = _KEYS[value] = _text(value)
    return found


def _canonical(value: object) -> object:
    """A hashable form of a JSON value, telling True from 1."""
    if isinstance(value, dict):
        return (dict, tuple((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return (list, tuple(_canonical(v) for v in value))
    return (type(value), value)


def _copy(value: Any) -> Any:
    """A deep copy of a JSON value (new dicts and lists; its strings interned: `_text`)."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict):
        return {_key(k): _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _shared(value: Any) -> Any:
    """One object for every equal value (conditions, port lists, IP families): read-only."""
    if value is None:
        return None
    kind = type(value)
    key: object
    if kind is str:
        key = value  # (the only str key: the others are bytes or tuples)
    elif kind is dict or kind is list:
        # Keyed by its JSON text (orjson, in C: an endpoint's conditions are 100,000 dicts at
        # 10,000 Services), which tells True from 1 and 1 from 1.0; equal dicts with their
        # keys in another order are only not shared. What orjson cannot write (a lone
        # surrogate, a key that is not a str) takes `_canonical`'s key.
        try:
            key = orjson.dumps(value)
        except orjson.JSONEncodeError:
            key = _canonical(value)
    else:
        key = (kind, value)  # what `_canonical` gives a scalar
    found = _SHARED.get(key)
    if found is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        found = _SHARED[key] = _copy(value)
    return found


class _AsSent(Mapping[str, Any]):
    """A read-only mapping kept in another form than a dict, equal to the dict it reads as."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self) == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to dicts, which are unhashable

    def __repr__(self) -> str:
        return repr(dict(self))


class Fields(_AsSent):
    """A few fields read as the dict the API sends (`get`, `[]`, iteration, equality with a
    dict), kept as two tuples: the keys (one tuple for every `Fields` of the same keys) and
    the values. An object's metadata, labels and annotations are each one (three per
    EndpointSlice, 60,000 at 10,000 Services): a dict of one to five keys costs 184 B, this
    96-128 B. Read-only."""

    __slots__ = ("_keys", "_values")

    def __init__(self, keys: tuple[str, ...], values: tuple[Any, ...]) -> None:
        found = _KEYSETS.get(keys)
        if found is None:
            if len(_KEYSETS) >= _KEYSETS_MAX:
                _KEYSETS.clear()
            found = _KEYSETS[keys] = keys
        self._keys = found
        self._values = values

    def get(self, key: str, default: Any = None) -> Any:
        keys = self._keys
        return self._values[keys.index(key)] if key in keys else default

    def __getitem__(self, key: str) -> Any:
        keys = self._keys
        if key in keys:
            return self._values[keys.index(key)]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __eq__(self, other: object) -> bool:
        if type(other) is Fields and other._keys is self._keys:
            return self._values == other._values
        return super().__eq__(other)  # (defining __eq__ leaves __hash__ None, as a dict's)


#: The key tuples of `Fields`, one per set of keys in order (a handful: the metadata's and
#: the labels' and annotations' the store keeps).
_KEYSETS: dict[tuple[str, ...], tuple[str, ...]] = {}
_KEYSETS_MAX: Final = 1_000
_NO_FIELDS: Final = Fields((), ())


def _pick(source: object, keys: Iterable[str]) -> Fields:
    if source is None or not (type(source) is dict or isinstance(source, Mapping)):
        return _NO_FIELDS
    found = tuple([k for k in keys if k in source])
    return Fields(found, tuple([_copy(source[k]) for k in found])) if found else _NO_FIELDS


def _metadata(obj: Obj, labels: Iterable[str], annotations: Iterable[str]) -> Fields:
    meta = obj.get("metadata")
    if not (type(meta) is dict or isinstance(meta, Mapping)):
        return _NO_FIELDS
    keys = [k for k in _META if k in meta]
    values = [_copy(meta[k]) for k in keys]
    if picked := _pick(meta.get("labels"), labels):
        keys.append("labels")
        values.append(picked)
    if picked := _pick(meta.get("annotations"), annotations):
        keys.append("annotations")
        values.append(picked)
    return Fields(tuple(keys), tuple(values))


#: Service spec fields whose value many Services repeat (kept once, `_shared`).
_SERVICE_SPEC_SHARED: Final = frozenset(
    {
        "ports",
        "ipFamilies",
        "ipFamilyPolicy",
        "type",
        "sessionAffinity",
        "sessionAffinityConfig",
        "internalTrafficPolicy",
        "externalTrafficPolicy",
        "trafficDistribution",
    }
)


def service(obj: Obj) -> dict[str, Any]:
    """A Service with only what the agent reads: identity, creation time, the proxy-name
    label, the topology annotations, the spec (but its selector) and status.loadBalancer."""
    if isinstance(obj, Compact):
        return obj
    out = Compact(metadata=_metadata(obj, _SERVICE_LABELS, _SERVICE_ANNOTATIONS))
    spec = obj.get("spec")
    if isinstance(spec, Mapping):
        out["spec"] = {
            _key(k): _shared(v) if k in _SERVICE_SPEC_SHARED else _copy(v)
            for k, v in spec.items()
            if k not in _SERVICE_SPEC_UNREAD
        }
    status = obj.get("status")
    if isinstance(status, Mapping) and status.get("loadBalancer"):
        out["status"] = {"loadBalancer": _copy(status["loadBalancer"])}
    return out


class Endpoint(EndpointFields, _AsSent):
    """One endpoint of a compact EndpointSlice, read as the mapping the API sends (`get`,
    `[]`, iteration, equality with a dict) but kept in slots: a cluster has an endpoint object
    per Pod and Service, 100,000 at 10,000 Services, and a dict of three keys costs about
    twice these slots. Every slot is set; a field the object did not carry (or carried as
    null, which the API reads as absent) holds None and is absent from the mapping. The
    node-local model's hot loop reads the slots as attributes (`addresses`, `conditions`,
    `hints`, `nodeName`, `zone`): a method call per field would cost it 7x the time."""

    __slots__ = _ENDPOINT

    @classmethod
    def of(cls, addresses: Any, conditions: Any, hints: Any, node: Any, zone: Any) -> Endpoint:
        """The endpoint of these fields (None: absent), without a mapping in between."""
        ep = cls.__new__(cls)
        ep.addresses, ep.conditions, ep.hints, ep.nodeName, ep.zone = (
            addresses,
            conditions,
            hints,
            node,
            zone,
        )
        return ep

    def get(self, key: str, default: Any = None) -> Any:
        if key in _ENDPOINT_FIELDS:
            value = getattr(self, key)
            if value is not None:
                return _as_sent(key, value)
        return default

    def __getitem__(self, key: str) -> Any:
        if key in _ENDPOINT_FIELDS:
            value = getattr(self, key)
            if value is not None:
                return _as_sent(key, value)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k in _ENDPOINT if getattr(self, k) is not None)

    def __len__(self) -> int:
        return sum(1 for k in _ENDPOINT if getattr(self, k) is not None)

    def __eq__(self, other: object) -> bool:
        if type(other) is Endpoint:
            return all(getattr(self, k) == getattr(other, k) for k in _ENDPOINT)
        return super().__eq__(other)  # (defining __eq__ leaves __hash__ None, as a dict's)


_ENDPOINT_FIELDS: Final = frozenset(_ENDPOINT)


def _as_sent(key: str, value: Any) -> Any:
    """A slot's value as the API sent it: `addresses` is kept as its one address (a str)
    or a tuple, and read as the list it was."""
    if key == "addresses":
        return [value] if isinstance(value, str) else list(value)
    return value


class Written(str):
    """An endpoint address kept as written because that is not an IP address in canonical
    form: the node-local model decides what it is. A plain str in a compact endpoint's
    addresses is one the store found canonical, which the model takes as it is."""

    __slots__ = ()


def _address(value: str) -> str:
    """An endpoint's address: as a plain str when it is an IP address in canonical form (one
    57 B string per IPv4 address for the store and the model: an `IP` object would cost 105 B
    in two blocks), as `Written` otherwise."""
    return value if type(value) is str and IP.is_canonical(value) else Written(value)


def _endpoint(ep: object) -> object:
    if type(ep) is not dict:  # (the API's endpoints are dicts: checked first, it is cheaper)
        if type(ep) is Endpoint:
            return ep
        if not isinstance(ep, Mapping):
            return _copy(ep)
    get = ep.get
    addresses = get("addresses")
    if type(addresses) is not list:  # not what the API sends: kept as sent, read as sent
        return _copy(ep)
    # Unique: not interned. One address (nearly every endpoint) is kept as that
    # str, several in a tuple (a list of one costs 88 B in two blocks, a str nothing more);
    # read as the list they were (`get`, `[]`).
    if len(addresses) == 1 and type(addresses[0]) is str:
        addresses = _address(addresses[0])
    else:
        addresses = tuple([_address(v) if isinstance(v, str) else v for v in addresses])
    hints, zone = get("hints"), get("zone")
    return Endpoint.of(
        addresses,
        _shared(get("conditions")),
        None if hints is None else _shared(hints),
        _shared(get("nodeName")),
        None if zone is None else _shared(zone),
    )


def _endpoints(endpoints: list[Any]) -> list[object]:
    """`_endpoint` of each endpoint. The usual one (a dict with one IPv4 address and no
    hints) is made here without a call per field: 100,000 endpoints at 10,000 Services, the
    hot loop of a list's decoding."""
    out: list[object] = []
    append = out.append
    shared = _SHARED
    new = object.__new__
    for ep in endpoints:
        if type(ep) is dict:
            get = ep.get
            addresses = get("addresses")
            if type(addresses) is list and len(addresses) == 1 and get("hints") is None:
                address = addresses[0]
                if type(address) is str and ":" not in address:
                    try:
                        _pton(_AF_INET, address)  # canonical dotted quads only
                    except (OSError, ValueError):
                        address = Written(address)
                    node, zone = get("nodeName"), get("zone")
                    if node is not None:
                        node = shared.get(node) if type(node) is str else None
                        if node is None:  # not shared yet, or not a str
                            node = _shared(get("nodeName"))
                    e = new(Endpoint)
                    e.addresses = address
                    e.conditions = _shared(get("conditions"))
                    e.hints = None
                    e.nodeName = node
                    e.zone = None if zone is None else _shared(zone)
                    append(e)
                    continue
        append(_endpoint(ep))
    return out


def endpoint_slice(obj: Obj) -> dict[str, Any]:
    """An EndpointSlice with only what the agent reads: identity, its Service's name, the
    change-trigger time, the address type, ports and each endpoint's addresses, conditions,
    hints, node and zone (not its targetRef)."""
    if isinstance(obj, Compact):
        return obj
    out = Compact(metadata=_metadata(obj, _SLICE_LABELS, _SLICE_ANNOTATIONS))
    for k in ("addressType", "ports"):
        if k in obj:
            out[k] = _shared(obj[k])
    endpoints = obj.get("endpoints")
    if isinstance(endpoints, list):
        out["endpoints"] = _endpoints(endpoints)
    return out
