"""The store keeps only the fields the agent reads (compact.py): the model decides the same from
the compact objects as from the whole ones, and a change of anything else records nothing."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from test_node_local import NODE, ROWS, ep, eps, svc

from kpx_agent.model.service_ports import EndpointFields, service_model
from kpx_agent.store import compact
from kpx_agent.store.cluster_state import SERVICES, SLICES, ClusterState

FAT_METADATA = {
    "uid": "0e3c6c39-8d5c-4b1d-9b5a-0c1f6f3f7a11",
    "resourceVersion": "123456",
    "generation": 3,
    "creationTimestamp": "2026-11-26T10:00:00Z",
    "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {}}}],
    "labels": {"app": "web", "team": "shop"},
    "annotations": {
        "kubectl.kubernetes.io/last-applied-configuration": "{" + "x" * 2000 + "}",
        "service.kubernetes.io/topology-mode": "Auto",
    },
}


def fat(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as the apiserver sends it: bookkeeping, labels, annotations, targetRefs."""
    out = copy.deepcopy(obj)
    meta = out.setdefault("metadata", {})
    for k, v in FAT_METADATA.items():
        if isinstance(v, dict):
            meta[k] = {**v, **meta.get(k, {})}
        else:
            meta.setdefault(k, v)
    if "spec" in out:
        out["spec"].setdefault("selector", {"app": "web"})
        out["spec"].setdefault("sessionAffinity", "None")
    for endpoint in out.get("endpoints") or []:
        endpoint["targetRef"] = {"kind": "Pod", "name": "web-1", "uid": "u", "resourceVersion": "1"}
    return out


def _addresses(*values: Any) -> dict[str, Any]:
    return {"addresses": values[0] if len(values) == 1 else list(values), "nodeName": "n2"}


#: Endpoint addresses of every shape the store keeps apart (compact.py): one canonical
#: address (a plain str), one written otherwise (`Written`: the model decides), several (a
#: tuple), none, and values the API would refuse (kept as sent, in a dict).
ADDRESS_CASES = {
    "several addresses": eps(_addresses("10.244.1.2", "10.244.1.3"), ep("10.244.1.4")),
    "leading zeros": eps(ep("10.244.01.2"), ep("10.244.1.3")),
    "ipv6 not canonical": eps(ep("2001:DB8:0::1"), ep("2001:db8::2"), family="IPv6"),
    "no address": eps(_addresses([]), ep("10.244.1.3")),
    "addresses not a list": eps(_addresses("10.244.1.2"), ep("10.244.1.3")),
    "address not a string": eps(_addresses([7]), ep("10.244.1.3")),
}

CASES = (
    [(row.service, row.slices) for row in ROWS]
    + [
        (
            svc(labels={"service.kubernetes.io/service-proxy-name": "other"}),
            [eps(ep("10.244.1.2"))],
        ),
        (
            svc(annotations={"service.kubernetes.io/topology-mode": "Auto"}),
            [eps(ep("10.244.1.2"))],
        ),
    ]
    + [
        (svc(clusterIP="fd00::10", clusterIPs=["fd00::10"]) if "ipv6" in k else svc(), [s])
        for k, s in ADDRESS_CASES.items()
    ]
)


@pytest.mark.parametrize(
    ("service", "slices"),
    CASES,
    ids=[r.name for r in ROWS] + ["proxy-name", "topology", *ADDRESS_CASES],
)
def test_the_model_decides_the_same_from_the_compact_objects(
    service: dict[str, Any], slices: list[dict[str, Any]]
) -> None:
    whole = service_model(fat(service), [fat(s) for s in slices], NODE)
    kept = service_model(
        compact.service(fat(service)), [compact.endpoint_slice(fat(s)) for s in slices], NODE
    )
    assert kept == whole


def test_what_the_store_keeps_is_what_is_read() -> None:
    service = compact.service(fat(svc()))
    assert service["metadata"] == {
        "name": "web",
        "namespace": "default",
        "creationTimestamp": "2026-11-26T10:00:00Z",
        "annotations": {"service.kubernetes.io/topology-mode": "Auto"},
    }
    assert "selector" not in service["spec"]
    (endpoint,) = compact.endpoint_slice(fat(eps(ep("10.244.1.2"))))["endpoints"]
    assert "targetRef" not in endpoint
    # An endpoint reads as the dict it came from, without being one (its fields in slots).
    assert not hasattr(endpoint, "__dict__")
    assert endpoint == {"addresses": ["10.244.1.2"], "nodeName": "n2"}
    assert endpoint.get("addresses") == ["10.244.1.2"] and endpoint.get("hints") is None
    assert endpoint.get("targetRef", "absent") == "absent"
    assert sorted(endpoint) == ["addresses", "nodeName"] and len(endpoint) == 2
    with pytest.raises(KeyError):
        endpoint["zone"]
    # The model's hot loop reads the slots as attributes (EndpointFields): absent is None.
    assert isinstance(endpoint, EndpointFields)
    assert (endpoint.addresses, endpoint.nodeName, endpoint.hints) == ("10.244.1.2", "n2", None)


def test_a_field_sent_as_null_reads_as_absent() -> None:
    """The API reads a null field as absent; so do the compact endpoint and the model."""
    (endpoint,) = compact.endpoint_slice(eps({**ep("10.244.1.2"), "hints": None, "zone": None}))[
        "endpoints"
    ]
    assert endpoint == {"addresses": ["10.244.1.2"], "nodeName": "n2"}
    assert endpoint.get("hints", "absent") == "absent" and "zone" not in endpoint


def test_an_update_of_a_field_nobody_reads_records_no_change() -> None:
    state = ClusterState()
    obj = fat(svc())
    state.upsert(SERVICES, obj)
    state.upsert(SLICES, fat(eps(ep("10.244.1.2"))))
    state.take_changes()
    relabelled = copy.deepcopy(obj)
    relabelled["metadata"]["resourceVersion"] = "123457"
    relabelled["metadata"]["labels"]["team"] = "payments"
    relabelled["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "{}"
    state.upsert(SERVICES, relabelled)
    assert not state.has_changes()
    moved = copy.deepcopy(relabelled)
    moved["spec"]["ports"][0]["port"] = 81
    state.upsert(SERVICES, moved)
    assert state.take_changes().services == {("default", "web")}


def _containers(value: object) -> list[object]:
    """Every dict and list in a value, the compact form's mappings read through."""
    if isinstance(value, Mapping):  # dicts, and the compact form's fields and endpoints
        return [value, *(c for v in value.values() for c in _containers(v))]
    if isinstance(value, (list, tuple)):
        return [value, *(c for v in value for c in _containers(v))]
    return []


@pytest.mark.parametrize("kind", [SERVICES, SLICES])
def test_the_compact_form_holds_no_container_of_the_decoded_object(kind: str) -> None:
    """So an item's decoded tree is freed once it is compacted (its strings may be kept)."""
    obj = fat(svc()) if kind == SERVICES else fat(eps(ep("10.244.1.2"), ep("10.244.1.3")))
    whole = orjson.loads(orjson.dumps(obj))  # as decoded
    kept = ClusterState().shrink(kind, whole)
    original = {id(c) for c in _containers(whole)}
    assert not [c for c in _containers(kept) if id(c) in original]
    assert ClusterState().shrink(kind, kept) is kept  # a compact object compacts to itself


def test_a_relisted_object_equal_to_the_stored_one_is_the_stored_one() -> None:
    state = ClusterState()
    state.upsert(SLICES, fat(eps(ep("10.244.1.2"))))
    (stored,) = state.slices.values()
    assert state.shrink(SLICES, fat(eps(ep("10.244.1.2")))) is stored
    changed = state.shrink(SLICES, fat(eps(ep("10.244.1.3"))))
    assert changed is not stored
    assert changed != stored


def test_any_string_compacts_lone_surrogates_too() -> None:
    """A string the JSON decoder may hand over (here a lone surrogate) is copied as it is,
    never an error that would fail the reflector."""
    obj = {"metadata": {"name": "a\ud800"}, "endpoints": [{"addresses": ["x\udc00"]}]}
    assert compact.endpoint_slice(obj) == obj


def test_shared_values_are_told_apart_by_type_and_shared_when_equal() -> None:
    """Equal values are one object (the flat conditions by their items, nested ones such as
    hints by their canonical form), but True is not 1 and 1 is not 1.0."""

    def endpoint(**fields: Any) -> Any:
        (out,) = compact.endpoint_slice(eps({"addresses": ["10.244.1.2"], **fields}))["endpoints"]
        return out

    ready = endpoint(conditions={"ready": True, "serving": True}).conditions
    assert endpoint(conditions={"ready": True, "serving": True}).conditions is ready
    as_int = endpoint(conditions={"ready": 1, "serving": True}).conditions
    assert as_int is not ready and type(as_int["ready"]) is int
    as_float = endpoint(conditions={"ready": 1.0, "serving": True}).conditions
    assert as_float is not as_int and type(as_float["ready"]) is float
    hints = {"forZones": [{"name": "a"}]}
    shared = endpoint(hints=hints).hints
    assert shared == hints and endpoint(hints={"forZones": [{"name": "a"}]}).hints is shared
    assert endpoint(hints={"forZones": [{"name": "b"}]}).hints is not shared


def test_an_endpoint_address_is_kept_as_a_plain_string_when_canonical() -> None:
    """One canonical address is kept as that str (no list, no `IP` object: memory), read as
    the list the API sent; other spellings are `Written` for the model to decide."""
    kept = compact.endpoint_slice(
        eps(ep("10.244.1.2"), ep("10.244.01.2"), _addresses("10.244.1.3", "10.244.1.4"))
    )
    one, odd, two = kept["endpoints"]
    assert type(one.addresses) is str and one["addresses"] == ["10.244.1.2"]
    assert type(odd.addresses) is compact.Written and odd.get("addresses") == ["10.244.01.2"]
    assert two.addresses == ("10.244.1.3", "10.244.1.4")
    assert two["addresses"] == ["10.244.1.3", "10.244.1.4"]
    sp = service_model(svc(), [kept], NODE).ports[0]
    assert [e.ip for e in sp.cluster_endpoints] == ["10.244.1.2", "10.244.1.3"]
    assert all(type(e.ip) is str for e in sp.cluster_endpoints)


#: Endpoints of every shape: the usual one (`_endpoints` makes it without a call per field)
#: and those it leaves to `_endpoint`.
ENDPOINT_SHAPES = {
    "usual": ep("10.244.1.2", ready=True),
    "no conditions": ep("10.244.1.2"),
    "zone": {**ep("10.244.1.2", ready=False, terminating=True), "zone": "a"},
    "node null": {**ep("10.244.1.2"), "nodeName": None},
    "node absent": {"addresses": ["10.244.1.2"]},
    "node not a str": {**ep("10.244.1.2"), "nodeName": 7},
    "node a map": {**ep("10.244.1.2"), "nodeName": {"x": 1}},
    "leading zeros": ep("10.244.01.2"),
    "null byte": ep("10.244.1.2\x00"),
    "not an address": ep("web"),
    "hints": ep("10.244.1.2", hints={"forZones": [{"name": "a"}]}),
    "ipv6": ep("fd00::1"),
    "two addresses": _addresses("10.244.1.2", "10.244.1.3"),
    "address not a str": _addresses([7]),
    "addresses not a list": _addresses("10.244.1.2"),
    "not a dict": ["10.244.1.2"],
}


@pytest.mark.parametrize("shape", ENDPOINT_SHAPES.values(), ids=ENDPOINT_SHAPES)
def test_the_usual_endpoint_is_kept_as_any_other(shape: Any) -> None:
    """`_endpoints`' fast path keeps an endpoint exactly as `_endpoint` does: the same
    fields, of the same types, shared values the same objects."""
    # Each decoded anew (fresh strings, as from a list): sharing is the store's doing.
    fast = compact._endpoints([orjson.loads(orjson.dumps(shape))])[0]
    slow = compact._endpoint(orjson.loads(orjson.dumps(shape)))
    assert type(fast) is type(slow) and fast == slow
    if type(slow) is compact.Endpoint:
        for name in ("addresses", "conditions", "hints", "nodeName", "zone"):
            mine, theirs = getattr(fast, name), getattr(slow, name)
            assert type(mine) is type(theirs) and mine == theirs, name
            if name in ("conditions", "nodeName", "zone"):
                assert mine is theirs, name  # one shared object


def _owned(slice_obj: dict[str, Any]) -> dict[str, Any]:
    slice_obj["metadata"]["labels"] = {"kubernetes.io/service-name": "web"}
    return slice_obj


def test_metadata_labels_and_annotations_read_as_the_dicts_they_were() -> None:
    """They are `Fields` (two tuples, the keys' shared by every object with the same keys):
    read and compared as the dicts the API sent."""
    one = compact.endpoint_slice(fat(_owned(eps(ep("10.244.1.2")))))
    two = compact.endpoint_slice(fat(_owned(eps(ep("10.244.1.3")))))
    meta = one["metadata"]
    assert isinstance(meta, compact.Fields) and isinstance(meta["labels"], compact.Fields)
    assert meta == {
        "name": "web-x",
        "namespace": "default",
        "creationTimestamp": FAT_METADATA["creationTimestamp"],
        "labels": {"kubernetes.io/service-name": "web"},
    }
    assert dict(meta) == meta and meta == dict(meta) and meta != {"name": "web-x"}
    assert meta.get("name") == meta["name"] == "web-x" and meta.get("uid", "-") == "-"
    assert "namespace" in meta and "uid" not in meta and len(meta) == len(list(meta)) == 4
    with pytest.raises(KeyError):
        meta["uid"]
    assert meta._keys is two["metadata"]._keys
    assert not compact.Fields((), ()) and compact.Fields((), ()) == {}
    service = compact.service(fat(svc(annotations={"service.kubernetes.io/topology-mode": "Auto"})))
    assert service["metadata"]["annotations"] == {"service.kubernetes.io/topology-mode": "Auto"}
    assert service["metadata"].get("labels") is None


def test_a_kept_object_passes_the_reflectors_check() -> None:
    """The reflector checks a list item again once kept (for a client that does not shrink
    as it decodes): the compact form, its `Fields` included, passes as the dict did."""
    from kpx_kube.watch_events import BadList, check_object

    for kept in (
        compact.service(fat(svc(annotations={"service.kubernetes.io/topology-mode": "Auto"}))),
        compact.endpoint_slice(fat(_owned(eps(ep("10.244.1.2"))))),
    ):
        assert check_object(kept, "a kept item", BadList) == ""
