"""A list body decoded item by item (kpx_kube.list_body) equals the body decoded whole, with
`item` applied to each item, whatever the chunks it arrives in; an item is decoded as soon as
it has arrived; bodies of another shape are decoded whole."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from kpx_kube.list_body import ListBody, decode_list


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


def _chunks(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize("size", [1, 5, 13, 64, 4096])
@pytest.mark.parametrize("count", [0, 1, 3])
def test_fed_in_chunks_equals_whole(size: int, count: int) -> None:
    """Any cut of the body into chunks (a boundary `},{"metadata":` split between two,
    an item's nested `},{"metadata":` that is not a boundary) decodes to the same list."""
    for body in (
        _body([_item(i) for i in range(count)]),
        _body([_item(i) for i in range(3)], indent=1),
    ):
        decoder = ListBody(_tag)
        for chunk in _chunks(body, size):
            decoder.feed(chunk)
        assert decoder.finish() == _expected(body)
        assert decoder.size == len(body)


def test_an_item_is_taken_as_soon_as_it_has_arrived() -> None:
    """The items that have arrived whole are decoded (and their bytes dropped) before the
    body ends: the decoder holds the rest of the body only."""
    seen: list[str] = []

    def keep_name(obj: dict[str, Any]) -> str:
        seen.append(obj["metadata"]["name"])
        return str(obj["metadata"]["name"])

    body = _body([_item(i) for i in range(20)])
    tenth = body.index(b'{"metadata":{"name":"s10"')  # + 12: its key, the boundary whole
    decoder = ListBody(keep_name)
    for chunk in _chunks(body[: tenth + 12], 100):
        decoder.feed(chunk)
    assert seen == [f"s{i}" for i in range(10)]
    for chunk in _chunks(body[tenth + 12 :], 100):
        decoder.feed(chunk)
    assert decoder.finish()["items"] == [f"s{i}" for i in range(20)]


def test_a_truncated_body_fed_in_chunks_raises_at_the_end() -> None:
    decoder = ListBody(_tag)
    for chunk in _chunks(_body([_item(i) for i in range(3)])[:-40], 16):
        decoder.feed(chunk)
    with pytest.raises(orjson.JSONDecodeError):
        decoder.finish()


def test_a_body_without_the_items_head_is_kept_whole_once_past_the_head() -> None:
    """A body whose items do not start where the apiserver puts them (here: whitespace after
    the key, with a large envelope) is not searched again at every chunk: it is kept whole
    and decoded at the end, as `orjson.loads` would."""
    items = [_item(i) for i in range(3)]
    body = json.dumps(
        {"kind": "ServiceList", "metadata": {"note": "x" * 70_000}, "items": items}
    ).encode()
    decoder = ListBody(_tag)
    decoder.feed(body[:80_000])
    assert decoder._whole
    decoder.feed(body[80_000:])
    assert decoder.finish() == _expected(body)
