"""A watch whose reflector task ended, or whose view may be wrong after an unexpected error, is
dead: the agent's health fails while it is (agent.dead_watches)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from kpx_agent.agent import dead_watches
from kpx_kube.reflector import Reflector, Resource


class Nothing:
    async def list(
        self, resource: str, path: str, params: Mapping[str, str], *, item: Any = None
    ) -> dict[str, Any]:
        raise AssertionError("not listed here")

    async def watch(
        self, resource: str, path: str, params: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        raise AssertionError("not watched here")
        yield {}


class Sink:
    def replace(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None: ...
    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None: ...
    def delete(self, kind: str, obj: Mapping[str, Any]) -> None: ...


def reflector(kind: str) -> Reflector:
    return Reflector(Nothing(), Resource(kind, f"/api/v1/{kind}"), Sink())


def test_a_failed_reflector_and_an_ended_task_are_dead_a_running_one_is_not() -> None:
    async def scenario() -> list[str]:
        async def crash() -> None:
            raise RuntimeError("boom")

        running = asyncio.create_task(asyncio.sleep(60))
        ended = asyncio.create_task(crash())
        failing = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)
        bad = reflector("endpointslices")
        bad.failure = "BadEvent: not an object"
        try:
            return dead_watches(
                [(reflector("services"), running), (reflector("nodes"), ended), (bad, failing)]
            )
        finally:
            running.cancel()
            failing.cancel()
            await asyncio.gather(running, failing, return_exceptions=True)

    assert asyncio.run(scenario()) == [
        "nodes: watch stopped: RuntimeError('boom')",
        "endpointslices: BadEvent: not an object",
    ]
