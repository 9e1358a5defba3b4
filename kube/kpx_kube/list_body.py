"""A list's JSON body decoded item by item, each item shrunk before the next is decoded.

A list served from the apiserver's watch cache (resourceVersion=0) comes in one body whatever
its `limit`: at 10,000 EndpointSlices, tens of MB of JSON that decode at once into a tree of
several times that size, beside the store. Decoded item by item, only the body and one item's
tree are held besides what is kept (`item`'s result).

The apiserver writes a list as `{"kind":..,"apiVersion":..,"metadata":{..},"items":[..]}` and
every item of a built-in list as `{"metadata":{..},..}` (kind and apiVersion, empty in list
items, are left out): the body is split where one item ends and the next begins
(`},{"metadata":`). Those bytes cannot occur inside a JSON string (its quotes are escaped),
and a split anywhere but between two items leaves a piece with unbalanced brackets, which does
not decode: then, and whenever the body does not have this shape, the whole body is decoded
at once instead. Either way the result is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

Item = Callable[[dict[str, Any]], Any]

_ITEMS = b'"items":['
_NEXT = b'},{"metadata":'
_FIRST = b'{"metadata":'


def _whole(body: bytes, item: Item) -> dict[str, Any]:
    data = orjson.loads(body)
    if isinstance(data, dict) and isinstance(data.get("items"), list):
        data["items"] = [item(obj) for obj in data["items"]]
    return data


def _split(body: bytes, item: Item) -> dict[str, Any] | None:
    """The list decoded item by item, or None when the body is not shaped as expected."""
    start = body.find(_ITEMS)
    end = body.rstrip().rfind(b"]")
    if start < 0 or end < start:
        return None
    first = start + len(_ITEMS)
    envelope = orjson.loads(body[:first] + body[end:])
    if not isinstance(envelope, dict) or envelope.get("items") != []:
        return None
    items: list[Any] = []
    if first == end:
        return envelope
    if not body.startswith(_FIRST, first):
        return None
    at = first
    while True:
        cut = body.find(_NEXT, at, end)
        piece = body[at : end if cut < 0 else cut + 1]
        obj = orjson.loads(piece)
        if not isinstance(obj, dict):
            return None
        items.append(item(obj))
        if cut < 0:
            break
        at = cut + 2  # the next item's opening brace
    envelope["items"] = items
    return envelope


def decode_list(body: bytes, item: Item) -> dict[str, Any]:
    """A list body decoded as `orjson.loads` would, with `item` applied to every item."""
    try:
        split = _split(body, item)
    except orjson.JSONDecodeError:
        split = None
    return split if split is not None else _whole(body, item)
