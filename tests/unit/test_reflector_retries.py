"""The reflector's waits after a watch ends (client-go's rules), its recovery from events it
cannot read, and the client keeping an answer's Retry-After; driven by a fake apiserver
(lists and watches scripted in order) and a recorded sleep (no real time passes)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import pytest
from aiohttp import web

from kpx_kube import errors
from kpx_kube.backoff import Backoff
from kpx_kube.client import Client
from kpx_kube.credentials import Credentials
from kpx_kube.reflector import Reflector, Resource

Obj = dict[str, Any]
RES = Resource("configmaps", "/api/v1/configmaps")


def cm(name: str, rv: str) -> Obj:
    return {"metadata": {"name": name, "resourceVersion": rv}}


class Names:
    def __init__(self) -> None:
        self.names: set[str] = set()

    def replace(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        self.names = {o["metadata"]["name"] for o in objs}

    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.names.add(obj["metadata"]["name"])

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.names.discard(obj["metadata"]["name"])


class Stop(BaseException):
    """Ends a scenario from inside the fake (not an Exception: the reflector lets it through)."""


Watch = list[object] | Exception  # the events of one watch (then the server ends it), or a refusal


class FakeApi:
    """Answers lists with `items` at resourceVersion "10"; each watch plays the next script
    entry (a list of events, where an Exception raised mid-stream, or an Exception raised when
    the watch is opened). Records every call as ("list"|"watch", params); Stop when the script
    is used up."""

    def __init__(self, watches: list[Watch], lists: list[list[Obj] | Exception] | None = None):
        self.watches = list(watches)
        self.lists = list(lists or [])
        self.calls: list[tuple[str, dict[str, str]]] = []

    async def list(
        self, resource: str, path: str, params: Mapping[str, str], *, item: Any = None
    ) -> Obj:
        self.calls.append(("list", dict(params)))
        items = self.lists.pop(0) if self.lists else [cm("a", "10")]
        if isinstance(items, Exception):
            raise items
        return {"items": items, "metadata": {"resourceVersion": "10"}}

    async def watch(
        self, resource: str, path: str, params: Mapping[str, str]
    ) -> AsyncIterator[Obj]:
        self.calls.append(("watch", dict(params)))
        if not self.watches:
            raise Stop()
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            if isinstance(event, Exception):
                raise event
            yield event  # type: ignore[misc]

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(
    api: FakeApi, clock: Clock | None = None, rand: float = 0.0
) -> tuple[Reflector, list[float]]:
    """Run a reflector against `api` until its script ends; (the reflector, the waits)."""
    clock = clock or Clock()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    reflector = Reflector(
        api,
        RES,
        Names(),
        backoff=Backoff(clock=clock, rand=lambda: rand),
        sleep=sleep,
        clock=clock,
    )
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    return reflector, slept


def gone() -> Obj:
    return {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}


def test_410_gone_relists_consistently_after_a_jittered_wait() -> None:
    api = FakeApi([[gone()], []])
    reflector, slept = run(api, rand=0.5)
    assert api.kinds()[:4] == ["list", "watch", "list", "watch"]
    # client-go's first wait: 800 ms, jittered up by as much again (here half of it).
    assert slept[0] == pytest.approx(1.2)
    assert "resourceVersion" not in api.calls[2][1]  # consistent: no resourceVersion=0
    assert reflector.lists == 2


def test_a_watch_closed_at_once_backs_off_exponentially_up_to_the_cap() -> None:
    api = FakeApi([[] for _ in range(10)])
    _, slept = run(api)
    # Each watch ended at once, with no event: 0.8 s doubling, at most 30 s (rand 0: no jitter).
    assert slept[:7] == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0])
    assert api.kinds().count("list") == 1  # watched again from the resourceVersion


def test_the_wait_starts_over_after_a_watch_that_lasted() -> None:
    clock = Clock()
    lasted: list[object] = [{"type": "ADDED", "object": cm("b", "11")}]  # a watch that worked
    api = FakeApi([[], [], lasted, []])
    _, slept = run(api, clock)
    assert slept == pytest.approx([0.8, 1.6, 0.8])


def test_429_waits_as_long_as_retry_after_says() -> None:
    throttled = errors.make_error(429, "TooManyRequests", "slow down", retry_after=7)
    api = FakeApi([throttled, []])
    _, slept = run(api)
    assert slept[0] == 7
    assert api.kinds()[:3] == ["list", "watch", "watch"]  # no relist for a throttled watch


def test_an_error_without_retry_after_backs_off() -> None:
    api = FakeApi([errors.make_error(503, "ServiceUnavailable", "busy"), []])
    _, slept = run(api, rand=0.25)
    assert slept[0] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad",
    [
        ["not", "an", "event"],
        {"type": "ADDED", "object": ["not", "an", "object"]},
        {"type": "MODIFIED", "object": "text"},
    ],
)
def test_an_event_it_cannot_read_fails_the_reflector_until_a_relist(bad: object) -> None:
    api = FakeApi([[{"type": "ADDED", "object": cm("b", "11")}, bad]])
    failures: list[str] = []
    original = api.list

    async def list_(
        resource: str, path: str, params: Mapping[str, str], *, item: Any = None
    ) -> Obj:
        failures.append(reflector.failure)
        return await original(resource, path, params, item=item)

    api.list = list_  # type: ignore[method-assign]
    clock = Clock()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        failures.append(reflector.failure)

    reflector = Reflector(
        api, RES, Names(), backoff=Backoff(clock=clock, rand=lambda: 0.0), sleep=sleep, clock=clock
    )
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    # First list: fine. The bad event: a failure, a wait, a new list (not a silent freeze),
    # and the failure is over once that list succeeded.
    assert api.kinds()[:4] == ["list", "watch", "list", "watch"]
    assert failures[0] == ""
    assert "BadEvent" in failures[1] and failures[1] == failures[2]  # while it waits to relist
    assert slept == [0.8]
    assert reflector.failure == ""
    assert reflector.failures == 1


class FailingStore(Names):
    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None:
        raise KeyError("the store cannot take it")


def test_a_failing_store_is_a_failure_and_a_relist() -> None:
    api = FakeApi([[{"type": "ADDED", "object": cm("b", "11")}], []])
    clock = Clock()

    async def sleep(seconds: float) -> None:
        clock.now += seconds

    reflector = Reflector(
        api,
        RES,
        FailingStore(),
        sleep=sleep,
        clock=clock,
        backoff=Backoff(clock=clock, rand=lambda: 0.0),
    )
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    assert api.kinds()[:3] == ["list", "watch", "list"]
    assert reflector.failures == 1


class KeepingApi(FakeApi):
    """Applies `item` to the items it answers, as the real client does while it decodes
    them; `keep_first` only to that many of them (a client that stopped half-way)."""

    def __init__(self, *args: Any, keep_first: int | None = None) -> None:
        super().__init__(*args)
        self.keep_first = keep_first

    async def list(
        self, resource: str, path: str, params: Mapping[str, str], *, item: Any = None
    ) -> Obj:
        data = await super().list(resource, path, params, item=item)
        if item is not None:
            n = len(data["items"]) if self.keep_first is None else self.keep_first
            data["items"] = [item(o) for o in data["items"][:n]] + data["items"][n:]
        return data


class Kept:
    """A store that keeps the objects, and a shrink that counts its calls per name."""

    def __init__(self) -> None:
        self.objs: dict[str, Obj] = {}
        self.shrunk: list[str] = []

    def shrink(self, obj: dict[str, Any]) -> Obj:
        if obj.get("kept"):
            return obj  # a kept object shrinks to itself, as the agent's store does
        self.shrunk.append(obj["metadata"]["name"])
        return {"metadata": obj["metadata"], "kept": True}

    def replace(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        self.objs = {o["metadata"]["name"]: dict(o) for o in objs}

    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.objs[obj["metadata"]["name"]] = dict(obj)

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.objs.pop(obj["metadata"]["name"], None)


@pytest.mark.parametrize(
    ("api", "checks"),
    [
        # (the client, the item checks: a client that stopped half-way has every item
        # checked again after it)
        pytest.param(lambda lists: FakeApi([[]], lists), 3, id="client-without-item"),
        pytest.param(lambda lists: KeepingApi([[]], lists), 3, id="client-keeping-each"),
        pytest.param(lambda lists: KeepingApi([[]], lists, keep_first=1), 4, id="client-half-way"),
    ],
)
def test_each_list_item_is_checked_and_shrunk_once(api: Any, checks: int) -> None:
    """Kept once, whoever kept it: a client that kept every item as it decoded it is not
    followed by a second pass over the page (20,000 calls at 10,000 Services' cold start)."""
    fake = api([[cm("a", "10"), cm("b", "10"), cm("c", "10")]])
    kept = Kept()
    checked: list[str] = []
    reflector = Reflector(fake, RES, kept, shrink=kept.shrink, sleep=_no_sleep)
    original = reflector._kept

    def counting(obj: Any) -> Any:
        checked.append(obj["metadata"]["name"])
        return original(obj)

    reflector._kept = counting  # type: ignore[method-assign]
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    assert sorted(kept.shrunk) == ["a", "b", "c"]
    assert all(o["kept"] for o in kept.objs.values()) and sorted(kept.objs) == ["a", "b", "c"]
    assert set(checked) == {"a", "b", "c"}  # every item checked (check_object), none skipped
    assert len(checked) == checks


async def _no_sleep(seconds: float) -> None:
    return None


def test_an_item_the_client_did_not_keep_is_still_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bad item the client left as it was (it kept only the first one) is refused: the
    list is a failure, listed again."""
    fake = KeepingApi([[]], [[cm("a", "10"), {"metadata": {"name": 7}}]], keep_first=1)
    reflector = Reflector(fake, RES, Kept(), sleep=_no_sleep)
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    assert fake.kinds()[:3] == ["list", "list", "watch"]
    assert reflector.failures == 1
    assert "metadata.name is not a string: 7" in caplog.text


def test_a_list_it_cannot_decode_is_a_failure_retried() -> None:
    api = FakeApi([[]], lists=[ValueError("not JSON"), [cm("a", "10")]])
    reflector, slept = run(api)
    assert api.kinds()[:3] == ["list", "list", "watch"]
    assert reflector.failures == 1 and reflector.failure == ""
    assert slept[0] == pytest.approx(0.8)


# -- the pure backoff ---------------------------------------------------------------------


def test_backoff_starts_over_two_minutes_after_the_last_wait_began() -> None:
    clock = Clock()
    backoff = Backoff(clock=clock, rand=lambda: 0.999)
    assert backoff.next() == pytest.approx(0.8 * 1.999)
    assert backoff.next() == pytest.approx(1.6 * 1.999)
    clock.now += 121
    assert backoff.next() == pytest.approx(0.8 * 1.999)


# -- Retry-After as the client reads it -------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "header", "expected"),
    [(429, "3", 3.0), (503, "1", 1.0), (429, None, None), (429, "soon", None), (404, "3", None)],
)
def test_retry_after_header(status: int, header: str | None, expected: float | None) -> None:
    assert errors.retry_after(status, header) == expected


def test_the_client_keeps_retry_after_on_a_throttled_list_and_watch() -> None:
    async def throttled(_: web.Request) -> web.Response:
        body = '{"kind":"Status","code":429,"reason":"TooManyRequests","message":"later"}'
        return web.Response(status=429, text=body, headers={"Retry-After": "4"})

    async def scenario() -> list[errors.ApiError]:
        app = web.Application()
        app.router.add_get("/api/v1/configmaps", throttled)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = Client(Credentials(f"http://127.0.0.1:{port}", ssl.create_default_context()))
        caught: list[errors.ApiError] = []
        try:
            for call in (
                client.list("configmaps", "/api/v1/configmaps", {}),
                anext(client.watch("configmaps", "/api/v1/configmaps", {})),
                client.get("/api/v1/configmaps"),
            ):
                with pytest.raises(errors.TooManyRequests) as info:
                    await call
                caught.append(info.value)
        finally:
            await client.close()
            await runner.cleanup()
        return caught

    assert [e.retry_after for e in asyncio.run(scenario())] == [4.0, 4.0, 4.0]
