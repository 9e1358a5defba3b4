"""List+watch of one resource, in the manner of client-go's reflector.

A full list (paginated) replaces the store's view; a watch from the list's resourceVersion then
streams changes, with bookmarks so a reconnect resumes where it stopped. The store sees nothing
of a list until the whole list has arrived.

When a watch ends, as client-go (tools/cache/reflector.go) does:

- the server ended a watch that lasted (its timeoutSeconds): watch again at once, from the last
  resourceVersion; the wait before the next retry starts over;
- the server closed a watch at once (under a second, no event: client-go's "very short
  watch"): wait (`backoff`: 800 ms doubling up to 30 s, jittered), then watch again;
- 410 Gone (the resourceVersion is older than the server keeps): wait as above, then list
  again, consistently (so every agent that lost its watch at the same moment does not relist
  at the same moment);
- silent for the client's idle timeout (a half-open connection: the apiserver's host lost, a
  NAT entry dropped): dropped and resumed at once from the last resourceVersion;
- refused with a `Retry-After` (429 from API Priority and Fairness, or a 5xx): wait as long
  as it says, then retry; any other refusal or a lost connection: wait as above, then resume
  from the last resourceVersion. With a `recovery` (the agent's), that wait ends early once
  the apiserver answers a probe again, after a random delay of up to 2 s (`recovery`): after
  an outage the agents resume within seconds, spread out;
- anything unexpected (an event or a list the decoder refuses, `watch_events`: a line that is
  not JSON, an object that is not one, a resourceVersion that is not a string, a bookmark
  without one; a store that fails on an object): logged, `failure` says it, and the reflector
  lists again after a wait (its view may have missed or mangled an event). `failure` stays
  set until a list succeeds: the agent's health fails while it is set (a dead watch).

A new field selector that only lets more or fewer namespaces through (`reselect`: the agent's
namespace opt-out) costs no list of everything: the watch is resumed from its resourceVersion
with the new selector, the namespaces it now lets through are listed alone (and merged into
the store), and the store forgets the namespaces it now leaves out. After a jittered wait, so
the agents of a cluster do not all ask at once when one namespace's label changes.

Each object is checked (`watch_events.check_object`) and shrunk as it arrives, before the next
list item or event is read (`shrink`; by default `slim`: managedFields and the last-applied
annotation dropped, what costs memory at scale and no reader of a reflector needs; the agent's
store keeps less still). A list thus holds its items in their kept form and one decoded item
at a time, never the whole raw list, and a relist holds the previous view only beside the kept
form of the new one.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .backoff import Backoff
from .errors import ApiError, Gone, WatchIdle
from .recovery import Recovery
from .watch_events import APPLIED, BadEvent, BadList, check_object, decode_event, decode_list

__all__ = ["BadEvent", "ListWatch", "Reflector", "Resource", "Sink", "slim"]

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Resource:
    kind: str  # the store's name for it (and the client's counters'), e.g. services
    path: str  # e.g. /api/v1/services
    label_selector: str = ""


class ListWatch(Protocol):
    """What a reflector asks the apiserver (`client.Client`)."""

    async def list(
        self,
        resource: str,
        path: str,
        params: Mapping[str, str],
        *,
        item: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Any: ...
    def watch(self, resource: str, path: str, params: Mapping[str, str]) -> AsyncIterator[Any]: ...


#: A watch the server ends sooner than this without an event was closed at once (client-go's
#: "very short watch"): the next one waits.
SHORT_WATCH = 1.0


class Sink(Protocol):
    """Where a reflector delivers: a full list, then single events."""

    def replace(self, kind: str, objs: Iterable[Obj]) -> None: ...
    def upsert(self, kind: str, obj: Obj) -> None: ...
    def delete(self, kind: str, obj: Obj) -> None: ...
    def forget_namespaces(self, kind: str, namespaces: Iterable[str]) -> None: ...


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop what a reflector's reader never reads and what costs memory at scale (managedFields, the
    last-applied annotation) before the object is stored."""
    meta = obj.get("metadata")
    if meta:
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if annotations:
            annotations.pop(LAST_APPLIED, None)
    return obj


class _Reselect(Exception):
    """The field selector changed (`reselect`): resume with it, no relist."""


class _Gone(Exception):
    """The watch cannot resume from its resourceVersion (410 Gone): list again, consistently."""


class Reflector:
    def __init__(
        self,
        client: ListWatch,
        resource: Resource,
        sink: Sink,
        field_selector: Callable[[], str] = lambda: "",
        on_event: Callable[[], None] = lambda: None,
        page_size: int = 5000,
        reselect_jitter: float = 2.0,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        recovery: Recovery | None = None,
        shrink: Callable[[dict[str, Any]], Obj] = slim,
    ) -> None:
        self.client = client
        self.shrink = shrink
        self.resource = resource
        self.sink = sink
        self.field_selector = field_selector
        self.on_event = on_event
        self.page_size = page_size
        self.synced = asyncio.Event()
        self.lists = 0
        # A new selector to resume with (`reselect`), the namespaces it now lets through (to
        # list alone) and those it now leaves out (to forget).
        self._reselect = asyncio.Event()
        self._include: set[str] = set()
        self._exclude: set[str] = set()
        self.reselect_jitter = reselect_jitter
        self.namespace_lists = 0
        self._selector_in_use = ""
        self._rv = ""  # the last resourceVersion seen (a list's, an event's or a bookmark's)
        self.backoff = backoff or Backoff()
        #: cuts a wait after a failed request short once the apiserver answers again
        self.recovery = recovery
        self.sleep = sleep
        self.clock = clock
        self._events = 0  # events (bookmarks too) the current watch delivered
        self._kept_items = 0  # list items `_kept` checked and shrunk, all lists together
        #: Why this reflector's view may be wrong ("" once a list succeeded after it): an
        #: unexpected error, after which it lists again. The agent's health fails meanwhile.
        self.failure = ""
        self.failures = 0  # unexpected errors so far

    def reselect(self, included: Iterable[str] = (), excluded: Iterable[str] = ()) -> None:
        """The field selector changed only in which namespaces it lets through: `included`
        now pass and did not, `excluded` do not any more. Resume the watch with it from where
        it is (no list of everything); list the included namespaces alone; forget the
        excluded ones' objects."""
        included, excluded = set(included), set(excluded)
        self._include = (self._include - excluded) | included
        self._exclude = (self._exclude - included) | excluded
        self._reselect.set()

    def _namespaced_path(self, namespace: str) -> str:
        """The resource's path within one namespace (/api/v1/namespaces/NS/services)."""
        prefix, _, plural = self.resource.path.rpartition("/")
        return f"{prefix}/namespaces/{namespace}/{plural}"

    async def _apply_reselect(self) -> None:
        """Take the new selector: forget what it leaves out, list what it lets in (each
        namespace alone, merged into the store). A failed list keeps the rest pending."""
        await self.sleep(random.uniform(0, self.reselect_jitter))  # noqa: S311 - jitter only
        self._reselect.clear()
        self._selector_in_use = self.field_selector()
        if self._exclude:
            self.sink.forget_namespaces(self.resource.kind, sorted(self._exclude))
            self._exclude.clear()
        for namespace in sorted(self._include):
            items, _ = await self._pages(self._namespaced_path(namespace), consistent=False)
            for item in items:
                self.sink.upsert(self.resource.kind, item)
            self._include.discard(namespace)
            self.namespace_lists += 1
            log.info(
                "%s: namespace %s listed alone (%d objects): the selector lets it through",
                self.resource.kind,
                namespace,
                len(items),
            )
        self.on_event()

    def _params(self) -> dict[str, str]:
        params: dict[str, str] = {}
        if self.resource.label_selector:
            params["labelSelector"] = self.resource.label_selector
        if self._selector_in_use:
            params["fieldSelector"] = self._selector_in_use
        return params

    def _kept(self, obj: Any) -> Obj:
        """A list item as decoded: checked, then shrunk (BadList when it is not an object
        with readable metadata)."""
        check_object(obj, f"a {self.resource.kind} list item", BadList)
        self._kept_items += 1
        return self.shrink(obj)

    async def _pages(self, path: str, consistent: bool) -> tuple[list[Obj], str]:
        """Every page of a list of `path` with the selectors in use: the items (checked and
        shrunk as each is decoded) and the last page's resourceVersion."""
        items: list[Obj] = []
        params = {**self._params(), "limit": str(self.page_size)}
        if not consistent:
            params["resourceVersion"] = "0"
        while True:
            kept_before = self._kept_items
            data = await self.client.list(self.resource.kind, path, params, item=self._kept)
            page = decode_list(data, items_checked=True)
            del data  # the decoded page goes now, not when the next one has arrived
            if self._kept_items - kept_before == len(page.items):
                items.extend(page.items)  # the client kept each item as it decoded it
            else:
                # A client that does not take `item` (or took it for some items only): check
                # and shrink here (a kept object passes and shrinks to itself).
                items.extend(self._kept(obj) for obj in page.items)
            if not page.continue_token:
                return items, page.resource_version
            params["continue"] = page.continue_token
            params.pop("resourceVersion", None)  # the token carries it; both are refused

    async def _list(self, consistent: bool = False) -> str:
        """List everything. By default from the apiserver's watch cache (resourceVersion=0,
        as client-go's reflectors do): no etcd read, and what the cache lacks the watch that
        follows brings. After 410 Gone, a consistent list, so the view never goes back."""
        self._reselect.clear()
        self._include.clear()
        self._exclude.clear()
        self._selector_in_use = self.field_selector()
        started = time.monotonic()
        items, rv = await self._pages(self.resource.path, consistent)
        received = time.monotonic()
        self.sink.replace(self.resource.kind, items)
        self.lists += 1
        log.debug(
            "listed %d %s in %.3f s (+ %.3f s to store them)",
            len(items),
            self.resource.kind,
            received - started,
            time.monotonic() - received,
        )
        self.synced.set()
        self.on_event()
        return rv

    async def _watch(self, rv: str) -> str:
        self._rv = rv
        self._events = 0
        params = {
            **self._params(),
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(random.randint(300, 600)),  # noqa: S311 - jitter only
        }
        async for doc in self.client.watch(self.resource.kind, self.resource.path, params):
            event = decode_event(doc)  # BadEvent: a failure, and a relist (run)
            if event.error is not None:
                if isinstance(event.error, Gone):
                    raise _Gone()
                raise event.error
            etype = event.type
            self._events += 1
            if etype not in APPLIED:  # as client-go: said, and skipped
                log.warning(
                    "%s: watch event of unknown type %r skipped", self.resource.kind, etype[:100]
                )
                continue
            obj = self.shrink(event.object)
            if event.resource_version:
                rv = self._rv = event.resource_version
            if etype in ("ADDED", "MODIFIED"):
                self.sink.upsert(self.resource.kind, obj)
            elif etype == "DELETED":
                self.sink.delete(self.resource.kind, obj)
            else:  # BOOKMARK: only the resourceVersion moves on
                continue
            self.on_event()
        return rv

    async def run(self) -> None:
        rv = ""
        gone = False  # the last watch ended with 410 Gone: the next list must be consistent
        while True:
            wait = 0.0
            failed_request = False  # the wait may end as soon as the apiserver answers
            try:
                if not rv:
                    rv = await self._list(consistent=gone)
                    gone = False
                    self.failure = ""
                elif self._reselect.is_set() or self._include:
                    await self._apply_reselect()
                started = self.clock()
                rv = await self._watch_until_reselect(rv)
                if self._events == 0 and self.clock() - started < SHORT_WATCH:
                    wait = self.backoff.next()
                    log.warning(
                        "%s: the watch was closed at once; watching again in %.1fs",
                        self.resource.kind,
                        wait,
                    )
                else:
                    self.backoff.reset()
            except WatchIdle as idle:
                rv = self._rv  # where the silent watch stopped: resume there, no relist
                log.debug(
                    "%s: watch %s; resuming from resourceVersion %s", self.resource.kind, idle, rv
                )
            except _Gone:
                rv, gone = "", True
                wait = self.backoff.next()
                log.info(
                    "%s: watch expired (410 Gone); listing again in %.1fs", self.resource.kind, wait
                )
            except _Reselect:
                rv = self._rv  # resume where the watch was, with the new selector
            except asyncio.CancelledError:
                raise
            except (ApiError, OSError, TimeoutError) as exc:
                if rv and self._rv:
                    rv = self._rv  # a broken watch resumes after the last event it delivered
                if isinstance(exc, Gone):
                    rv, gone = "", True
                told = exc.retry_after if isinstance(exc, ApiError) else None
                wait = told if told is not None else self.backoff.next()
                failed_request = told is None  # Retry-After is honoured to the end
                log.warning("%s: %s; retrying in %.1fs", self.resource.kind, exc, wait)
            except Exception as exc:  # a bad event, a failing store: list again
                rv = ""
                self.failures += 1
                self.failure = f"{type(exc).__name__}: {exc}"[:500]
                wait = self.backoff.next()
                log.exception(
                    "%s: unexpected error, listing again in %.1fs", self.resource.kind, wait
                )
            if wait > 0 and failed_request and self.recovery is not None:
                if await self.recovery.wait(wait):
                    self.backoff.reset()  # it is back: a 410 next waits 0.8 s, not 30-60
            elif wait > 0:
                await self.sleep(wait)

    async def _watch_until_reselect(self, rv: str) -> str:
        """Watch; a new selector (`reselect`) while the stream is idle ends it too."""
        watch = asyncio.create_task(self._watch(rv))
        reselect = asyncio.create_task(self._reselect.wait())
        tasks = (watch, reselect)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                return watch.result()
            raise _Reselect()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
