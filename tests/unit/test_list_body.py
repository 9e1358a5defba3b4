"""A list body decoded item by item (kpx_kube.list_body) equals the body decoded whole, with
`item` applied to each item; bodies of another shape are decoded whole."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from kpx_kube.list_body import decode_list


def _tag(obj: dict[str, Any]) -> dict[str, Any]:
    return {**obj, "seen": True}


def _expected(body: bytes) -> Any:
    data = orjson.loads(body)
    data["items"] = [_tag(o) for o in data["items"]]
    return data


def _item(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"s{i}", "annotations": {"a": '},{"metadata":{"x":1}'}},
        "spec": {"ports": [{"port": 80}], "nested": [{"metadata": {"n": i}}, {"metadata": 2}]},
    }


def _body(items: list[dict[str, Any]], **kw: Any) -> bytes:
    doc = {"kind": "ServiceList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}}
    return json.dumps({**doc, "items": items}, separators=(",", ":"), **kw).encode()


@pytest.mark.parametrize("count", [0, 1, 2, 50])
def test_item_by_item_equals_whole(count: int) -> None:
    body = _body([_item(i) for i in range(count)])
    assert decode_list(body, _tag) == _expected(body)


def test_each_item_is_shrunk_as_it_is_decoded() -> None:
    """`item` sees every item once, in order; its result is what the list holds."""
    seen: list[str] = []

    def keep_name(obj: dict[str, Any]) -> str:
        seen.append(obj["metadata"]["name"])
        return str(obj["metadata"]["name"])

    data = decode_list(_body([_item(i) for i in range(3)]), keep_name)
    assert data["items"] == ["s0", "s1", "s2"] == seen
    assert data["metadata"] == {"resourceVersion": "7"}


@pytest.mark.parametrize(
    "body",
    [
        _body([_item(i) for i in range(3)], indent=1),  # whitespace: not the apiserver's shape
        b'{"items":[{"spec":{},"metadata":{}},{"metadata":{}}],"metadata":{}}',  # items after
        b'{"kind":"List","items":[{"a":1},{"b":2}]}',  # items not starting with metadata
    ],
)
def test_other_shapes_are_decoded_whole(body: bytes) -> None:
    assert decode_list(body, _tag) == _expected(body)


def test_a_body_that_is_not_json_raises_as_orjson_does() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        decode_list(b'{"items":[{"metadata":{}},{"metadata":', _tag)
