"""Fuzz what a watch or a list hands the reflector (issue #22, "hostile and random input"):
arbitrary lines, events of every shape (not JSON, not an object, no metadata, resourceVersions
of the wrong type, BOOKMARK and ERROR events with odd payloads, huge and deeply nested
values). The decoder (kpx_kube.watch_events) returns an event or raises its own error naming
the problem, nothing else; and in a running reflector a bad event never ends the task, never
sends a garbled resourceVersion back to the apiserver, and fails the reflector (the agent's
health: agent.dead_watches) until a list succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fuzz_loaders import FUZZ as LOADER_FUZZ
from test_reflector_retries import RES, Clock, FakeApi, Names, Stop, cm

from kpx_kube.backoff import Backoff
from kpx_kube.errors import ApiError, Gone, from_response, from_status
from kpx_kube.reflector import Reflector
from kpx_kube.watch_events import (
    BadEvent,
    BadList,
    decode_event,
    decode_line,
    decode_list,
)

# Derandomized, as test_fuzz_loaders: the same examples on every run.
FUZZ = settings(LOADER_FUZZ, max_examples=300)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            "ADDED",
            "MODIFIED",
            "DELETED",
            "BOOKMARK",
            "ERROR",
            "Status",
            "10",
            "",
            "410",
            "Expired",
            "kube-system",
        ]
    ),
)
KEYS = [
    "type",
    "object",
    "metadata",
    "name",
    "namespace",
    "resourceVersion",
    "labels",
    "annotations",
    "managedFields",
    "kind",
    "code",
    "reason",
    "message",
    "items",
    "continue",
    "spec",
    "status",
]


def documents() -> st.SearchStrategy[Any]:
    key = st.one_of(st.sampled_from(KEYS), st.text(max_size=6))
    return st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(key, inner, max_size=6)
        ),
        max_leaves=30,
    )


@st.composite
def events(draw: st.DrawFn) -> Any:
    """Mostly event-shaped: a known type, an object with metadata of any shape."""
    if draw(st.integers(0, 9)) == 0:
        return draw(documents())
    meta = draw(
        st.one_of(
            documents(),
            st.fixed_dictionaries(
                {},
                optional={
                    "name": st.one_of(st.text(max_size=8), SCALARS),
                    "namespace": st.one_of(st.text(max_size=8), SCALARS),
                    "resourceVersion": st.one_of(st.text("0123456789", max_size=6), documents()),
                    "labels": documents(),
                    "annotations": documents(),
                    "managedFields": documents(),
                },
            ),
        )
    )
    obj = draw(st.one_of(st.fixed_dictionaries({"metadata": st.just(meta)}), documents()))
    etype = draw(
        st.one_of(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]), SCALARS)
    )
    doc = {"type": etype, "object": obj}
    if draw(st.booleans()):
        doc.pop(draw(st.sampled_from(["type", "object"])))
    return doc


def nested(depth: int) -> Any:
    doc: Any = "x"
    for _ in range(depth):
        doc = {"metadata": doc}
    return doc


# ---- the decoder ----------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300))
@example(b"{")
@example(b"[" * 2000)  # deeper than the JSON parser goes
@example(b'{"type": "ADDED", "object": ' + b"[" * 600 + b"]" * 600 + b"}")
def test_any_line_decodes_or_is_a_bad_event(line: bytes) -> None:
    try:
        doc = decode_line(line)
    except BadEvent as exc:
        assert "a watch line that is not JSON" in str(exc)
        return
    with contextlib.suppress(BadEvent):
        decode_event(doc)


@FUZZ
@given(events())
@example({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": None}}})
@example({"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": {"x": 1}}}})
@example({"type": "ERROR", "object": {"kind": "Status", "code": "abc"}})
@example({"type": "ERROR", "object": {"code": [410]}})
@example({"type": "ERROR", "object": {"code": 1e300}})
@example({"type": "ADDED", "object": {"metadata": "text"}})
@example({"type": "ADDED", "object": {"metadata": {"name": "a", "annotations": ["x"]}}})
def test_any_event_decodes_or_is_a_bad_event_naming_the_problem(doc: Any) -> None:
    try:
        event = decode_event(doc)
    except BadEvent as exc:
        assert str(exc).startswith("a ")  # says which event, and what of it
        assert len(str(exc)) < 600  # a huge value is not copied into the message
        return
    assert isinstance(event.type, str) and isinstance(event.object, dict)
    assert isinstance(event.resource_version, str)
    if event.type == "ERROR":
        assert isinstance(event.error, ApiError)
    if event.type == "BOOKMARK":
        assert event.resource_version  # the one thing a bookmark is for


def test_deep_and_huge_values() -> None:
    """Nesting as deep as the JSON parser takes (and deeper), a megabyte of name: an event or
    a BadEvent whose message stays short. (Not through hypothesis: it cannot print them.)"""
    for depth in (500, 1023, 1024, 5000):
        line = b'{"type": "ADDED", "object": ' + b'{"metadata": ' * depth + b"1" + b"}" * depth
        try:
            doc = decode_line(line + b"}")
        except BadEvent as exc:
            assert depth >= 1024 and len(str(exc)) < 600
            continue
        with pytest.raises(BadEvent) as bad:
            decode_event(doc)
        assert len(str(bad.value)) < 600
    with pytest.raises(BadEvent, match=r"metadata.name is not a string: <dict>$"):
        decode_event({"type": "ADDED", "object": {"metadata": {"name": nested(5000)}}})
    huge = decode_event({"type": "ADDED", "object": {"metadata": {"name": "a" * 1_000_000}}})
    assert len(huge.object["metadata"]["name"]) == 1_000_000
    with pytest.raises(BadEvent) as bad:
        decode_event({"type": "ADDED", "object": {"metadata": {"name": ["a" * 1_000_000]}}})
    assert len(str(bad.value)) < 600


@FUZZ
@given(documents())
@example({"items": {"a": 1}})
@example({"items": [{"metadata": {"name": "a"}}, "b"]})
@example({"metadata": {"resourceVersion": 10}})
@example({"metadata": {"continue": ["x"]}, "items": []})
def test_any_list_answer_decodes_or_is_a_bad_list(doc: Any) -> None:
    try:
        page = decode_list(doc)
    except BadList as exc:
        assert str(exc).startswith("a list answer")
        return
    assert all(isinstance(i, dict) for i in page.items)
    assert isinstance(page.resource_version, str) and isinstance(page.continue_token, str)


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ([1], "a watch event that is not an object"),
        ({"type": 3}, "a watch event whose type is not a string: 3"),
        ({"type": "ADDED", "object": None}, "a ADDED event: the object is not an object"),
        ({"type": "ADDED", "object": {}}, "a ADDED event: the object has no metadata.name"),
        ({"type": "ADDED", "object": {"metadata": "x"}}, "metadata is not an object: 'x'"),
        ({"type": "DELETED", "object": {"metadata": {"name": 7}}}, "metadata.name is not a string"),
        (
            {"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": 12}}},
            "a MODIFIED event: metadata.resourceVersion is not a string: 12",
        ),
        (
            {"type": "BOOKMARK", "object": {"metadata": {}}},
            "a BOOKMARK event without a metadata.resourceVersion",
        ),
        (
            {"type": "ADDED", "object": {"metadata": {"name": "a", "labels": [1]}}},
            "metadata.labels is not a map",
        ),
    ],
)
def test_bad_events_name_the_field_and_the_reason(doc: Any, reason: str) -> None:
    with pytest.raises(BadEvent, match=reason.replace("(", r"\(")):
        decode_event(doc)


def test_error_events_of_any_shape_are_errors() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    assert isinstance(decode_event({"type": "ERROR", "object": status}).error, Gone)
    for odd in (
        None,
        [],
        "text",
        {"code": "abc"},
        {"code": [410]},
        {"code": 1e300},
        {"code": True},
        {"code": "410"},
    ):
        error = decode_event({"type": "ERROR", "object": odd}).error
        assert isinstance(error, ApiError)
    assert isinstance(decode_event({"type": "ERROR", "object": {"code": "410"}}).error, Gone)
    assert decode_event({"type": "SOMETHING", "object": 1}).type == "SOMETHING"  # skipped later


def test_a_status_with_a_code_that_is_no_number_is_an_error_of_unknown_status() -> None:
    """Regression: int("abc") raised ValueError out of the error path."""
    assert from_status({"code": "abc", "message": "m"}).status == 0
    assert from_status({"code": [1]}).status == 0
    body = orjson.dumps({"kind": "Status", "code": "x", "reason": "Weird", "message": "m"})
    assert from_response(500, body).status == 500


# ---- a running reflector --------------------------------------------------------------------


def run_watching(
    events_: list[object],
    lists: list[Any] | None = None,
) -> tuple[Reflector, FakeApi, list[str]]:
    """A reflector that lists (rv 10), watches `events_`, then whatever follows (a relist
    and an empty watch), until the script ends; the failures it had while it waited."""
    api = FakeApi([events_, [], []], lists=lists)
    clock = Clock()
    seen: list[str] = []

    async def sleep(seconds: float) -> None:
        seen.append(reflector.failure)
        clock.now += seconds

    reflector = Reflector(
        api, RES, Names(), backoff=Backoff(clock=clock, rand=lambda: 0.0), sleep=sleep, clock=clock
    )
    with pytest.raises(Stop):  # the script ended: the reflector was still running
        asyncio.run(reflector.run())
    return reflector, api, seen


def watched_from(api: FakeApi) -> list[str]:
    return [params["resourceVersion"] for kind, params in api.calls if kind == "watch"]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": None}}},
        {"type": "BOOKMARK", "object": {"metadata": {}}},
        {"type": "MODIFIED", "object": {"metadata": {"name": "b", "resourceVersion": {"x": 1}}}},
        {"type": "ADDED", "object": {"metadata": {"name": "b", "resourceVersion": ["12"]}}},
    ],
)
def test_a_garbled_resource_version_is_never_sent_back(bad: object) -> None:
    """Regression: the watch resumed from "None" or "{'x': 1}": refused by the apiserver at
    every retry while the reflector looked healthy (a frozen view). Now a bad event: the
    reflector fails until it listed again, and resumes from the list's resourceVersion."""
    reflector, api, seen = run_watching([{"type": "ADDED", "object": cm("a", "11")}, bad])
    assert watched_from(api)[:2] == ["10", "10"] and api.kinds()[:3] == ["list", "watch", "list"]
    assert seen and seen[0].startswith("BadEvent: a ") and "resourceVersion" in seen[0]
    assert reflector.failure == "" and reflector.failures == 1


def test_a_bad_metadata_is_a_bad_event_not_a_crash_in_the_store() -> None:
    """Regression: `metadata: "text"` failed in slim() with AttributeError."""
    reflector, api, seen = run_watching([{"type": "ADDED", "object": {"metadata": "text"}}])
    assert seen[0] == "BadEvent: a ADDED event: metadata is not an object: 'text'"
    assert api.kinds()[:3] == ["list", "watch", "list"] and reflector.failure == ""


def test_an_error_event_with_an_odd_status_ends_the_watch_as_an_error() -> None:
    """Regression: a Status whose code is no number raised ValueError (a relist, and a
    failure); it is an error of unknown status: the watch resumes where it was."""
    reflector, api, _ = run_watching(
        [
            {"type": "ADDED", "object": cm("a", "11")},
            {"type": "ERROR", "object": {"kind": "Status", "code": "abc"}},
        ]
    )
    assert api.kinds()[:3] == ["list", "watch", "watch"] and watched_from(api)[1] == "11"
    assert reflector.failures == 0


def test_a_list_whose_items_are_not_a_list_is_a_bad_list() -> None:
    """Regression: items {"a": 1} were iterated as keys and failed in slim()."""
    reflector, api, seen = run_watching([], lists=[{"a": 1}, [cm("a", "10")]])
    assert seen[0] == "BadList: a list answer whose items are not a list: {'a': 1}"
    assert api.kinds()[:3] == ["list", "list", "watch"] and reflector.failure == ""


@FUZZ
@given(events())
def test_no_event_ends_the_reflector_or_garbles_its_resource_version(bad: Any) -> None:
    reflector, api, seen = run_watching([{"type": "ADDED", "object": cm("a", "11")}, bad])
    obj = bad.get("object") if isinstance(bad, dict) else None
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    sent = meta.get("resourceVersion") if isinstance(meta, dict) else None
    for rv in watched_from(api):  # the list's, the good event's, or the one the event gave
        assert rv in ("10", "11") or (isinstance(sent, str) and rv == sent), (rv, bad)
    # A failure, if any, is the decoder's (or the store's: Names reads metadata.name).
    assert all(f == "" or f.startswith("BadEvent: ") for f in seen), seen
    assert reflector.failure == ""  # listed again since


def test_a_dead_watch_fails_health_until_the_relist() -> None:
    """While the reflector waits to list again after a bad event, agent.dead_watches names it
    (the agent's /healthz and /livez answer 503 then); after the list, nothing."""
    from kpx_agent.agent import dead_watches

    api = FakeApi([[{"type": "ADDED", "object": {"metadata": [1]}}], []])
    clock = Clock()
    during: list[list[str]] = []

    async def scenario() -> list[str]:
        async def sleep(seconds: float) -> None:
            during.append(dead_watches([(reflector, task)]))

        reflector = Reflector(
            api,
            RES,
            Names(),
            backoff=Backoff(clock=clock, rand=lambda: 0.0),
            sleep=sleep,
            clock=clock,
        )
        task = asyncio.create_task(reflector.run())
        with contextlib.suppress(Stop):
            await task
        return dead_watches([(reflector, asyncio.create_task(asyncio.sleep(0)))])

    after = asyncio.run(scenario())
    # The wait before the relist; then (the next watch closed at once) a wait after it.
    assert during == [["configmaps: BadEvent: a ADDED event: metadata is not an object: [1]"], []]
    assert after == []


def test_the_client_decodes_lines_and_list_bodies_into_the_decoders_errors() -> None:
    """Regression: a watch line that is not JSON raised orjson's JSONDecodeError out of the
    client, a list body that is a JSON array an AttributeError (`data.get`) inside it."""
    import ssl

    from aiohttp import web

    from kpx_kube.client import Client
    from kpx_kube.credentials import Credentials

    bodies = iter([b"[1, 2]", b"<html>busy</html>"])

    async def list_(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") == "1":
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b'{"type": "ADDED", "object": {"metadata": {"name": "a"}}}\n')
            await resp.write(b"garbage\n")
            await resp.write_eof()
            return resp
        return web.Response(body=next(bodies), content_type="application/json")

    async def scenario() -> tuple[Any, str, list[Any], str]:
        app = web.Application()
        app.router.add_get("/api/v1/configmaps", list_)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = Client(Credentials(f"http://127.0.0.1:{port}", ssl.create_default_context()))
        try:
            array = await client.list("configmaps", "/api/v1/configmaps", {})
            with pytest.raises(BadList) as not_json:
                await client.list("configmaps", "/api/v1/configmaps", {})
            seen: list[Any] = []
            with pytest.raises(BadEvent) as bad_line:
                async for doc in client.watch("configmaps", "/api/v1/configmaps", {}):
                    seen.append(doc)
        finally:
            await client.close()
            await runner.cleanup()
        return array, str(not_json.value), seen, str(bad_line.value)

    array, not_json, seen, bad_line = asyncio.run(scenario())
    assert array == [1, 2]
    with pytest.raises(BadList, match="a list answer that is not an object: \\[1, 2\\]"):
        decode_list(array)
    assert "a list answer that is not JSON" in not_json and "busy" in not_json
    assert [decode_event(doc).object["metadata"]["name"] for doc in seen] == ["a"]
    assert bad_line.startswith("a watch line that is not JSON") and "garbage" in bad_line
