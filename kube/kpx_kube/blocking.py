"""kpx_kube's `Client` for synchronous code (the test harness, the benchmarks).

The async client runs on an event loop of its own, in a daemon thread; each call waits for
its result. `many` sends a batch with at most `concurrency` requests in flight on that loop
(kept-alive connections, no thread per request).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from .client import Client, Obj, Reply
from .credentials import Credentials

T = TypeVar("T")


class BlockingClient:
    def __init__(self, creds: Credentials, **client_options: Any) -> None:
        self.client = Client(creds, **client_options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kpx-kube", daemon=True)
        self._thread.start()

    @property
    def server(self) -> str:
        return self.client.server

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the client's loop and wait for its result (or exception)."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the client's calls -------------------------------------------------------------------

    def request(self, method: str, path: str, **kw: Any) -> Reply:
        return self.run(self.client.request(method, path, **kw))

    def get(self, path: str, params: Mapping[str, str] | None = None) -> Obj:
        return self.run(self.client.get(path, params))

    def get_or_none(self, path: str) -> Obj | None:
        return self.run(self.client.get_or_none(path))

    def create(self, path: str, body: Mapping[str, Any]) -> Obj:
        return self.run(self.client.create(path, body))

    def replace(self, path: str, body: Mapping[str, Any]) -> Obj:
        return self.run(self.client.replace(path, body))

    def patch(self, path: str, body: Any, *, patch: str = "merge") -> Obj:
        return self.run(self.client.patch(path, body, patch=patch))

    def patch_status(self, path: str, status: Mapping[str, Any]) -> Obj:
        return self.run(self.client.patch_status(path, status))

    def apply(self, path: str, obj: Mapping[str, Any], **kw: Any) -> Reply:
        return self.run(self.client.apply(path, obj, **kw))

    def apply_object(self, obj: Mapping[str, Any], **kw: Any) -> Reply:
        return self.run(self.client.apply_object(obj, **kw))

    def path_of(self, obj: Mapping[str, Any], *, collection: bool = False) -> str:
        return self.run(self.client.path_of(obj, collection=collection))

    def delete(self, path: str, **kw: Any) -> bool:
        return self.run(self.client.delete(path, **kw))

    def many(
        self, calls: Iterable[Callable[[Client], Awaitable[T]]], concurrency: int = 8
    ) -> list[T]:
        """Each call(client), at most `concurrency` at once; the results in order (the first
        exception is raised once all have ended)."""

        async def batch() -> list[T]:
            gate = asyncio.Semaphore(concurrency)

            async def one(call: Callable[[Client], Awaitable[T]]) -> T:
                async with gate:
                    return await call(self.client)

            results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results  # type: ignore[return-value]

        return self.run(batch())
