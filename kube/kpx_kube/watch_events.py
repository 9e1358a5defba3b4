"""What a list or a watch of the apiserver sends, checked before a reflector trusts it (pure).

A watch sends one JSON document per line, `{"type": ..., "object": ...}`; a list page is
`{"metadata": {"resourceVersion", "continue"}, "items": [...]}`. The reflector stores the
objects and resumes its watches from their resourceVersion, so what it takes from them must have
the right shape: a resourceVersion that is not a string (or a bookmark without one) would be
sent back on the next watch, refused, and retried for ever while the agent looks healthy; a
`metadata` that is not an object would fail deep in the store.

`decode_line`, `decode_event` and `decode_list` either return what they read or raise
`BadEvent` / `BadList` (both `BadAnswer`, a ValueError) naming the field and the reason;
nothing else escapes them, whatever the input. The reflector treats either as an unexpected
answer: its `failure` is set (the agent's health fails) and it lists again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import orjson

from .errors import ApiError, from_status

#: The event types a reflector applies; any other is logged and skipped, as client-go does.
APPLIED = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
ERROR = "ERROR"
_SHOWN = 200  # characters of a bad value quoted in an error


class BadAnswer(ValueError):
    """A list or watch answer that is not what the apiserver sends: says what and why."""


class BadEvent(BadAnswer):
    """A watch event a reflector cannot read."""


class BadList(BadAnswer):
    """A list answer a reflector cannot read."""


@dataclass(frozen=True)
class Event:
    type: str
    #: The object (ADDED, MODIFIED, DELETED, BOOKMARK); {} for ERROR and for unknown types.
    object: dict[str, Any]
    #: The object's metadata.resourceVersion; "" when it has none (then the watch's stays).
    resource_version: str = ""
    #: What an ERROR event carries (its Status; Gone for 410).
    error: ApiError | None = None


@dataclass(frozen=True)
class ListPage:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a value so deep that repr gives up: its type will do
        text = f"<{type(value).__name__}>"
    return text[:_SHOWN]


def decode_json(data: bytes, what: str, error: type[BadAnswer]) -> Any:
    """`data` as JSON; `error` naming `what` when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} that is not JSON ({exc}): {_show(data)}") from None


def decode_line(line: bytes) -> Any:
    """One line of a watch's stream as JSON (its shape is `decode_event`'s)."""
    return decode_json(line, "a watch line", BadEvent)


def _optional_string(meta: Mapping[str, Any], key: str, where: str, error: type[BadAnswer]) -> str:
    value = meta.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise error(f"{where}: metadata.{key} is not a string: {_show(value)}")
    return value


def check_object(obj: Any, where: str, error: type[BadAnswer], named: bool = True) -> str:
    """Check what the reflector and its store read of an object (an object, its metadata an
    object with string name, namespace and resourceVersion, label and annotation maps; a
    name when `named`); its resourceVersion ("" without one)."""
    if not isinstance(obj, dict):
        raise error(f"{where}: the object is not an object: {_show(obj)}")
    meta = obj.get("metadata")
    if meta is None:
        meta = {}
    elif not isinstance(meta, Mapping):  # (a dict as decoded; a kept object's may be another)
        raise error(f"{where}: metadata is not an object: {_show(meta)}")
    name = _optional_string(meta, "name", where, error)
    _optional_string(meta, "namespace", where, error)
    if named and not name:
        raise error(f"{where}: the object has no metadata.name")
    for key in ("labels", "annotations"):
        if meta.get(key) is not None and not isinstance(meta[key], Mapping):
            raise error(f"{where}: metadata.{key} is not a map: {_show(meta[key])}")
    return _optional_string(meta, "resourceVersion", where, error)


def decode_event(doc: Any) -> Event:
    """One watch event. An ERROR event's Status becomes its `error` (whatever its shape: an
    error it is); a type the reflector does not apply is returned as it is, to be skipped."""
    if not isinstance(doc, dict):
        raise BadEvent(f"a watch event that is not an object: {_show(doc)}")
    etype = doc.get("type")
    if not isinstance(etype, str):
        raise BadEvent(f"a watch event whose type is not a string: {_show(etype)}")
    if etype == ERROR:
        return Event(etype, {}, error=from_status(doc.get("object")))
    if etype not in APPLIED:
        return Event(etype, {})
    obj = doc.get("object")
    where = f"a {etype} event"
    rv = check_object(obj, where, BadEvent, named=etype != "BOOKMARK")
    if etype == "BOOKMARK" and not rv:
        raise BadEvent(f"{where} without a metadata.resourceVersion")
    return Event(etype, cast(dict[str, Any], obj), rv)


def decode_list(doc: Any, items_checked: bool = False) -> ListPage:
    """One page of a list: its items (each checked as `check_object` does, unless the
    decoding already did: `items_checked`), its resourceVersion and its continue token (""
    on the last page)."""
    if not isinstance(doc, dict):
        raise BadList(f"a list answer that is not an object: {_show(doc)}")
    meta = doc.get("metadata")
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise BadList(f"a list answer whose metadata is not an object: {_show(meta)}")
    rv = _optional_string(meta, "resourceVersion", "a list answer", BadList)
    token = _optional_string(meta, "continue", "a list answer", BadList)
    items = doc.get("items")
    if items is None:
        items = []
    elif not isinstance(items, list):
        raise BadList(f"a list answer whose items are not a list: {_show(items)}")
    for index, item in enumerate(() if items_checked else items):
        check_object(item, f"a list answer's item {index}", BadList)
    return ListPage(items, rv, token)
