"""A list's JSON body decoded item by item as it arrives, each item shrunk before the next.

A list served from the apiserver's watch cache (resourceVersion=0) comes in one body whatever
its `limit`: at 10,000 EndpointSlices about 25 MB of JSON, 75 MB at 30,000, that decode at
once into a tree of several times that size, beside the store. Fed chunk by chunk as the
apiserver sends them (`ListBody.feed`), an item is decoded as soon as it has arrived and its
bytes are dropped: only one chunk, one item's tree and what is kept (`item`'s result) are
held, and the decoding overlaps the apiserver's sending.

The apiserver writes a list as `{"kind":..,"apiVersion":..,"metadata":{..},"items":[..]}` and
every item of a built-in list as `{"metadata":{..},..}` (kind and apiVersion, empty in list
items, are left out). An item ends where `},{"metadata":` follows it. Those bytes cannot occur
inside a JSON string (its quotes are escaped), but they can inside an item (an array of
objects whose first key is `metadata`): a piece from an item's start to such a place has
unbalanced brackets and does not decode, so the piece grows to the next one until it
decodes. A piece that decodes to an object is one whole item: the piece starts at the item's
opening brace, and JSON is only valid when the brace that ends it is the one that closes it.

What is left when the body ends (the last item and the envelope's end) is decoded with the
envelope, which is the body less the items taken out: valid JSON whenever the body is. A body
of another shape (another first key in the items, the items not at the envelope's top level,
whitespace) is kept whole and decoded at once. Either way the result is what `orjson.loads`
gives with `item` applied to every item.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

Item = Callable[[dict[str, Any]], Any]

_ITEMS = b'"items":['
_NEXT = b'},{"metadata":'
_FIRST = b'{"metadata":'
#: How far into the body the items' `[` is looked for: the envelope's head (kind, apiVersion,
#: the list's metadata) is a few hundred bytes; past this the body is not the apiserver's
#: shape and is kept whole (no search of the whole body again at every chunk).
_HEAD_MAX = 64 * 1024


class ListBody:
    """One list body, fed in chunks (`feed`), decoded when it ends (`finish`)."""

    def __init__(self, item: Item) -> None:
        self._item = item
        self._buf = bytearray()
        self._head: bytes | None = None  # the envelope up to its items' `[`, once checked
        self._whole = False  # not the apiserver's shape: kept whole, decoded at the end
        self._scan = 0  # where the search for the next item's end resumes
        self._items: list[Any] = []
        self.size = 0  # bytes fed

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._buf += chunk
        if self._whole:
            return
        if self._head is None and not self._start():
            return
        self._take()

    def _start(self) -> bool:
        """Find and check the envelope's head; True once the items may be taken."""
        buf = self._buf
        at = buf.find(_ITEMS, 0, _HEAD_MAX)
        if at < 0:
            self._whole = len(buf) >= _HEAD_MAX
            return False
        first = at + len(_ITEMS)
        if len(buf) < first + len(_FIRST) and not buf.startswith(b"]", first):
            return False  # the first item's key has not arrived yet
        head = bytes(buf[:first])
        try:
            envelope = orjson.loads(head + b"]}")
        except orjson.JSONDecodeError:
            envelope = None
        if (
            not isinstance(envelope, dict)
            or envelope.get("items") != []
            or not (buf.startswith(_FIRST, first) or buf.startswith(b"]", first))
        ):
            self._whole = True
            return False
        self._head = head
        del buf[:first]
        return True

    def _take(self) -> None:
        """Decode and take every whole item at the buffer's start."""
        buf = self._buf
        start, scan = 0, self._scan
        with memoryview(buf) as view:
            while (cut := buf.find(_NEXT, scan)) >= 0:
                try:
                    obj = orjson.loads(view[start : cut + 1])
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict):
                    self._items.append(self._item(obj))
                    start = cut + 2  # the next item's opening brace
                scan = cut + 1
        if start:
            del buf[:start]
        # a boundary may straddle this chunk and the next
        self._scan = max(scan - start, len(buf) - len(_NEXT) + 1, 0)

    def finish(self) -> dict[str, Any]:
        """The decoded list (orjson.JSONDecodeError for a body that is not JSON)."""
        if self._head is None:
            return _whole(bytes(self._buf), self._item)
        data = orjson.loads(self._head + self._buf)
        if not isinstance(data, dict) or not isinstance(data.get("items"), list):
            raise orjson.JSONDecodeError("the list's envelope changed shape", "", 0)
        self._items.extend(self._item(obj) for obj in data["items"])
        data["items"] = self._items
        self._buf = bytearray()
        return data


def _whole(body: bytes, item: Item) -> dict[str, Any]:
    data = orjson.loads(body)
    if isinstance(data, dict) and isinstance(data.get("items"), list):
        data["items"] = [item(obj) for obj in data["items"]]
    return data


def decode_list(body: bytes, item: Item) -> dict[str, Any]:
    """A list body decoded as `orjson.loads` would, with `item` applied to every item."""
    decoder = ListBody(item)
    decoder.feed(body)
    return decoder.finish()
