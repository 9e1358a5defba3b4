"""A namespace opting in or out costs no relist of everything (issue #22, "namespace opt-out
without relist storms"): the reflector resumes its watch with the new field selector, lists the
namespace that now passes alone, and the store forgets the one that no longer does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from kpx_agent.store.cluster_state import SERVICES, ClusterState
from kpx_kube.reflector import Reflector, Resource

Obj = dict[str, Any]


def svc(ns: str, name: str, rv: str) -> Obj:
    return {
        "metadata": {"namespace": ns, "name": name, "resourceVersion": rv},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]},
    }


class Stop(BaseException):
    pass


class FakeApi:
    """Everything in `objs`; a list honours `metadata.namespace!=` selectors and namespaced
    paths. The first watch delivers one event, then waits (until the reflector ends it); the
    second ends the scenario."""

    def __init__(self, objs: list[Obj]) -> None:
        self.objs = objs
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.watching = asyncio.Event()

    async def list(
        self, resource: str, path: str, params: Mapping[str, str], *, item: Any = None
    ) -> Obj:
        self.calls.append(("list", path, dict(params)))
        left_out = {
            term.split("!=", 1)[1]
            for term in params.get("fieldSelector", "").split(",")
            if term.startswith("metadata.namespace!=")
        }
        parts = path.split("/")
        only = parts[parts.index("namespaces") + 1] if "namespaces" in parts else None
        items = [
            o
            for o in self.objs
            if o["metadata"]["namespace"] not in left_out
            and only in (None, o["metadata"]["namespace"])
        ]
        return {"items": items, "metadata": {"resourceVersion": "10"}}

    async def watch(
        self, resource: str, path: str, params: Mapping[str, str]
    ) -> AsyncIterator[Obj]:
        self.calls.append(("watch", path, dict(params)))
        if sum(kind == "watch" for kind, _, _ in self.calls) > 1:
            raise Stop()
        yield {"type": "MODIFIED", "object": svc("a", "web", "11")}
        self.watching.set()
        await asyncio.Event().wait()


def test_opting_in_and_out_resumes_the_watch_and_lists_one_namespace() -> None:
    api = FakeApi([svc("a", "web", "5"), svc("b", "db", "6"), svc("b", "cache", "7")])
    state = ClusterState()
    excluded = {"b"}

    def selector() -> str:
        return ",".join(f"metadata.namespace!={ns}" for ns in sorted(excluded))

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    reflector = Reflector(
        api, Resource(SERVICES, "/api/v1/services"), state, field_selector=selector, sleep=sleep
    )

    async def scenario() -> None:
        task = asyncio.create_task(reflector.run())
        await api.watching.wait()
        assert set(state.services) == {("a", "web")}
        excluded.clear()
        excluded.add("a")  # b opts back in, a opts out
        reflector.reselect(included={"b"}, excluded={"a"})
        with pytest.raises(Stop):
            await task

    asyncio.run(scenario())
    lists = [(path, params) for kind, path, params in api.calls if kind == "list"]
    assert lists[0][0] == "/api/v1/services"  # the start's one list of everything
    assert [path for path, _ in lists[1:]] == ["/api/v1/namespaces/b/services"]
    assert lists[1][1]["fieldSelector"] == "metadata.namespace!=a"
    watches = [params for kind, _, params in api.calls if kind == "watch"]
    assert watches[1]["resourceVersion"] == "11"  # resumed where it was
    assert watches[1]["fieldSelector"] == "metadata.namespace!=a"
    assert set(state.services) == {("b", "db"), ("b", "cache")}  # a forgotten, b listed
    assert reflector.lists == 1 and reflector.namespace_lists == 1
    assert len(slept) == 1 and 0 <= slept[0] <= reflector.reselect_jitter  # spread, jittered
