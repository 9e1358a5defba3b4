"""The watch layer against a real apiserver: lists come from the watch cache, a watch that
cannot resume (a real 410 Gone) is followed by a consistent list, and nothing is lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_harness import Kube

from kpx_cluster.controlplane import Cluster
from kpx_kube import Client as KubeClient
from kpx_kube import from_kubeconfig
from kpx_kube.reflector import Reflector, Resource

# The apiserver keeps no watch cache for Events (its default), so a watch from an old
# resourceVersion goes to etcd, whose compacted history answers 410 Gone for real. Services
# and EndpointSlices are cached; the reflector code is the same for every resource.
EVENTS = Resource("events", "/api/v1/events")

pytestmark = pytest.mark.e2e


class Names:
    """A sink that keeps object names, and counts full lists."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def replace(self, kind: str, objs: Iterable[Mapping[str, Any]]) -> None:
        self.names = {o["metadata"]["name"] for o in objs}

    def upsert(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.names.add(obj["metadata"]["name"])

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.names.discard(obj["metadata"]["name"])


def event(ns: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": ns},
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": ns},
        "reason": "Test",
        "message": "reflector test",
    }


class WatchedEvents:
    """A Reflector on the Events of one namespace, with each list request's parameters
    recorded; `after_list(n)` runs after the n-th list response (blocking calls are fine)."""

    def __init__(
        self,
        cluster: Cluster,
        ns: str,
        page_size: int = 5000,
        after_list: Callable[[int], object] = lambda n: None,
    ) -> None:
        self.client = KubeClient(from_kubeconfig(cluster.kubeconfig))
        self.lists: list[dict[str, str]] = []
        self.sink = Names()
        real_list = self.client.list

        async def recording_list(
            resource: str, path: str, params: Mapping[str, str], *, item: Any = None
        ) -> dict[str, Any]:
            self.lists.append(dict(params))
            data = await real_list(resource, path, params, item=item)
            after_list(len(self.lists))
            return data

        self.client.list = recording_list  # type: ignore[method-assign]
        self.reflector = Reflector(
            self.client,
            EVENTS,
            self.sink,
            field_selector=lambda: f"metadata.namespace={ns}",
            page_size=page_size,
        )

    async def __aenter__(self) -> WatchedEvents:
        self.task = asyncio.create_task(self.reflector.run())
        await asyncio.wait_for(self.reflector.synced.wait(), 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()

    @staticmethod
    async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
        for _ in range(int(timeout / 0.05)):
            if check():
                return
            await asyncio.sleep(0.05)


def test_watch_gone_relists_consistently_and_keeps_up(cluster: Cluster, kube: Kube) -> None:
    ns = kube.create_namespace(prefix="reflector")
    kube.apply(event(ns, "before"))

    def expire(n: int) -> None:
        if n == 1:
            # The list's resourceVersion, then more writes, then etcd compacts its history
            # (as the apiserver has it do every 5 minutes): a watch from that
            # resourceVersion can no longer resume. (Two writes: etcd keeps the compaction
            # revision itself, and a watch from the list's resourceVersion starts after it.)
            kube.apply(event(ns, "between"), event(ns, "between-2"))
            cluster.compact_etcd()

    async def scenario() -> WatchedEvents:
        async with WatchedEvents(cluster, ns, after_list=expire) as watched:
            await watched.until(lambda: len(watched.lists) >= 2)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, kube.apply, event(ns, "after"))
            await watched.until(lambda: "after" in watched.sink.names)
        return watched

    watched = asyncio.run(scenario())
    lists = watched.lists
    assert len(lists) == 2, lists
    assert lists[0].get("resourceVersion") == "0", lists  # the first list: from the cache
    assert "resourceVersion" not in lists[1], lists  # after 410 Gone: a consistent list
    # The relist brought what the lost watch missed, and the new watch what came after.
    names = watched.sink.names
    assert {"before", "between", "between-2", "after"} <= names, names


def test_paginated_list_follows_continue_tokens(cluster: Cluster, kube: Kube) -> None:
    """A list in pages of one: every page after the first carries only the continue token
    (the apiserver refuses a resourceVersion next to it), and every object arrives."""
    ns = kube.create_namespace(prefix="pages")
    kube.apply(*(event(ns, f"e{i}") for i in range(3)))

    async def scenario() -> WatchedEvents:
        async with WatchedEvents(cluster, ns, page_size=1) as watched:
            return watched

    watched = asyncio.run(scenario())
    pages = watched.lists
    assert watched.sink.names == {"e0", "e1", "e2"}, watched.sink.names
    assert len(pages) >= 3, pages
    assert all("continue" in p and "resourceVersion" not in p for p in pages[1:]), pages


def test_compression_follows_the_kubeconfig(
    cluster: Cluster, kube: Kube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As client-go: big lists come gzip-compressed, unless the kubeconfig's cluster says
    `disable-compression: true` (a fast network: both sides save the CPU)."""
    ns = kube.create_namespace()
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "big", "namespace": ns},
            "data": {f"k{i}": "x" * 1000 for i in range(300)},  # well above the 128 KiB floor
        }
    )
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["disable-compression"] = True
    plain = tmp_path / "plain.kubeconfig"
    plain.write_text(yaml.safe_dump(config))

    async def list_once(kubeconfig: Path) -> None:
        client = KubeClient(from_kubeconfig(kubeconfig))
        try:
            path = f"/api/v1/namespaces/{ns}/configmaps"
            data = await client.list("configmaps", path, {"fieldSelector": "metadata.name=big"})
            assert [item["metadata"]["name"] for item in data["items"]] == ["big"]
        finally:
            await client.close()

    caplog.set_level(logging.DEBUG, logger="kpx_kube.client")
    asyncio.run(list_once(cluster.kubeconfig))
    asyncio.run(list_once(plain))
    encodings = [r.getMessage().split("(")[1].split(")")[0] for r in caplog.records]
    assert encodings == ["gzip", "identity"], encodings


def test_a_silent_watch_is_resumed_without_a_relist(cluster: Cluster, kube: Kube) -> None:
    """A watch on a resource nobody writes hears nothing (no bookmark either: the apiserver
    sends one only once the resourceVersion moved past the watch's); each idle timeout drops
    it and it resumes from its last resourceVersion: no list again, and a later change arrives."""
    ns = kube.create_namespace(prefix="idle")
    names = Names()

    async def scenario() -> tuple[int, int]:
        client = KubeClient(from_kubeconfig(cluster.kubeconfig), watch_idle_timeout=1.0)
        resource = Resource("configmaps", f"/api/v1/namespaces/{ns}/configmaps")
        reflector = Reflector(client, resource, names)
        task = asyncio.create_task(reflector.run())
        try:
            await asyncio.wait_for(reflector.synced.wait(), 10)
            for _ in range(150):  # three idle timeouts (1 s each, plus each resume's time)
                if client.watch_idle_timeouts["configmaps"] >= 3:
                    break
                await asyncio.sleep(0.1)
            await asyncio.to_thread(
                kube.apply,
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "late", "namespace": ns},
                },
            )
            for _ in range(50):
                if "late" in names.names:
                    break
                await asyncio.sleep(0.1)
            return reflector.lists, client.watch_idle_timeouts["configmaps"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()

    try:
        lists, idle = asyncio.run(scenario())
    finally:
        kube.delete("namespace", ns)
    assert "late" in names.names
    assert idle >= 3
    assert lists == 1


def test_the_apiservers_list_bodies_are_decoded_item_by_item(
    cluster: Cluster, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Services and EndpointSlices as the apiserver lists them (from the watch cache, as the
    agent's first list, and consistently, as after 410 Gone) have the shape list_body splits:
    with the whole-body fallback disabled, every item still arrives, each through `item`."""
    from agent_harness import endpoint_slice, service

    from kpx_kube import list_body

    ns = kube.create_namespace(prefix="split")
    ports = [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]
    kube.apply(*(service(f"s{i}", ns, ports) for i in range(3)))
    kube.apply(
        *(
            endpoint_slice(
                f"s{i}-a",
                ns,
                f"s{i}",
                [{"addresses": [f"10.244.0.{i + 1}"]}],
                [("http", 8080, "TCP")],
            )
            for i in range(3)
        )
    )

    def refused(body: bytes, item: Any) -> dict[str, Any]:
        raise AssertionError("the body was decoded whole")

    monkeypatch.setattr(list_body, "_whole", refused)

    async def names(path: str, params: dict[str, str]) -> list[str]:
        client = KubeClient(from_kubeconfig(cluster.kubeconfig))
        try:
            data = await client.list("x", path, params, item=lambda o: o["metadata"]["name"])
        finally:
            await client.close()
        return sorted(data["items"])

    for path in (
        f"/api/v1/namespaces/{ns}/services",
        f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    ):
        want = ["s0", "s1", "s2"] if "services" in path else ["s0-a", "s1-a", "s2-a"]
        assert asyncio.run(names(path, {"resourceVersion": "0", "limit": "500"})) == want
        assert asyncio.run(names(path, {"limit": "500"})) == want


def test_a_list_whose_item_is_refused_still_counts_its_answer(cluster: Cluster, kube: Kube) -> None:
    """`item` refusing an item while the body streams: the error reaches the caller and the
    request is observed with the apiserver's status, as for any answer."""
    ns = kube.create_namespace(prefix="refused")
    kube.apply(  # several: the first is decoded while the body streams, not at its end
        *(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "namespace": ns}}
            for n in ("one", "two", "three")
        )
    )
    seen: list[tuple[str, str]] = []

    def refuse(obj: dict[str, Any]) -> Any:
        raise ValueError(f"refused {obj['metadata']['name']}")

    async def scenario() -> None:
        client = KubeClient(from_kubeconfig(cluster.kubeconfig))
        client.observer = lambda method, _host, code, _dt: seen.append((method, code))
        try:
            await client.list("x", f"/api/v1/namespaces/{ns}/configmaps", {}, item=refuse)
        finally:
            await client.close()

    with pytest.raises(ValueError, match=r"^refused "):
        asyncio.run(scenario())
    assert seen == [("GET", "200")]
