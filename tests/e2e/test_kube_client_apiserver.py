"""kpx_kube's client against a real apiserver: each refusal is its typed error, server-side
apply creates, repairs and conflicts as the apiserver decides, and the blocking client is the
same client."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kpx_cluster.controlplane import Cluster
from kpx_kube import (
    AlreadyExists,
    Client,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    Unauthorized,
    Unreachable,
    from_kubeconfig,
)
from kpx_kube.blocking import BlockingClient
from kpx_kube.credentials import Credentials
from kpx_kube.tls import ssl_context

pytestmark = pytest.mark.e2e
T = TypeVar("T")


def run(cluster: Cluster, scenario: Callable[[Client], Awaitable[T]], **kw: Any) -> T:
    async def main() -> T:
        client = Client(from_kubeconfig(cluster.kubeconfig), user_agent="kpx-e2e", **kw)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.fixture
def ns(cluster: Cluster) -> Iterator[str]:
    name = f"kc-{secrets.token_hex(3)}"
    with BlockingClient(from_kubeconfig(cluster.kubeconfig)) as kube:
        kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
        yield name
        kube.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


def configmap(ns: str, name: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns},
        "data": data,
    }


def test_apply_creates_then_updates_and_takes_fields_over_only_with_force(
    cluster: Cluster, ns: str
) -> None:
    path = f"/api/v1/namespaces/{ns}/configmaps/cm"

    async def scenario(client: Client) -> None:
        created = await client.apply(path, configmap(ns, "cm", a="1"), field_manager="one")
        assert created.status == 201 and created.body["data"] == {"a": "1"}
        again = await client.apply(path, configmap(ns, "cm", a="2"), field_manager="one")
        assert again.status == 200 and again.body["data"] == {"a": "2"}
        # Another manager setting a field "one" owns: a conflict, unless forced.
        with pytest.raises(Conflict) as conflict:
            await client.apply(path, configmap(ns, "cm", a="3"), field_manager="two", force=False)
        assert conflict.value.status == 409 and conflict.value.reason == "Conflict"
        assert "conflict" in conflict.value.message.lower()
        forced = await client.apply(path, configmap(ns, "cm", a="3"), field_manager="two")
        assert forced.body["data"] == {"a": "3"}
        managers = {m["manager"] for m in forced.body["metadata"]["managedFields"]}
        assert "two" in managers
        # By kind: a built-in kind from kpx_kube's table, another through discovery
        other = await client.apply_object(configmap(ns, "other", b="1"), field_manager="one")
        assert other.status == 201
        assert await client.path_of(other.body) == f"/api/v1/namespaces/{ns}/configmaps/other"
        sent = client.requests_sent
        assert await client.kind_path("v1", "Secret") == ("/api/v1", "secrets", True)
        rbac = "rbac.authorization.k8s.io/v1"
        assert await client.kind_path(rbac, "ClusterRole") == (
            f"/apis/{rbac}",
            "clusterroles",
            False,
        )
        assert client.requests_sent == sent + 2  # one discovery request per group version
        assert await client.kind_path("v1", "Secret") == ("/api/v1", "secrets", True)
        assert client.requests_sent == sent + 2  # cached

    run(cluster, scenario)


def test_refusals_are_typed(cluster: Cluster, ns: str, tmp_path: Path) -> None:
    base = f"/api/v1/namespaces/{ns}/configmaps"

    async def scenario(client: Client) -> None:
        with pytest.raises(NotFound) as missing:
            await client.get(f"{base}/nope")
        assert missing.value.status == 404 and missing.value.reason == "NotFound"
        assert await client.get_or_none(f"{base}/nope") is None
        assert await client.delete(f"{base}/nope", missing_ok=True) is False
        with pytest.raises(NotFound):
            await client.delete(f"{base}/nope")

        first = await client.create(base, configmap(ns, "c", a="1"))
        with pytest.raises(AlreadyExists) as exists:
            await client.create(base, configmap(ns, "c", a="1"))
        assert isinstance(exists.value, Conflict) and exists.value.reason == "AlreadyExists"

        await client.replace(f"{base}/c", {**first, "data": {"a": "2"}})
        with pytest.raises(Conflict) as stale:  # first's resourceVersion is gone
            await client.replace(f"{base}/c", {**first, "data": {"a": "3"}})
        assert type(stale.value) is Conflict

        with pytest.raises(Invalid) as invalid:
            await client.create(base, configmap(ns, "Not_A_Name"))
        assert invalid.value.status == 422

        patched = await client.patch(f"{base}/c", {"data": {"b": "x"}})
        assert patched["data"] == {"a": "2", "b": "x"}
        assert await client.delete(f"{base}/c") is True

    run(cluster, scenario)

    nobody = cluster.client_kubeconfig("kc-nobody", (), tmp_path / "nobody.kubeconfig")

    async def forbidden() -> None:
        client = Client(from_kubeconfig(nobody))
        try:
            with pytest.raises(Forbidden) as refused:
                await client.get(base)
            assert refused.value.status == 403 and "forbidden" in refused.value.message
        finally:
            await client.close()

    asyncio.run(forbidden())

    ca_only = ssl_context(ca=cluster.ca_file.read_bytes())  # no client certificate

    async def unauthorized() -> None:
        client = Client(Credentials(cluster.server, ca_only, token="not-a-token"))
        unreachable = Client(Credentials("https://127.0.0.1:1", ca_only))
        try:
            with pytest.raises(Unauthorized) as refused:
                await client.get(base)
            assert refused.value.status == 401
            with pytest.raises(Unreachable) as nothing:
                await unreachable.get(base)
            assert nothing.value.status == 0
        finally:
            await client.close()
            await unreachable.close()

    asyncio.run(unauthorized())


def test_status_patch_and_watch(cluster: Cluster, ns: str) -> None:
    async def scenario(client: Client) -> None:
        listing = await client.list("services", f"/api/v1/namespaces/{ns}/services", {})
        rv = listing["metadata"]["resourceVersion"]
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s", "namespace": ns},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
        }
        await client.apply_object(svc, field_manager="kpx-e2e")
        lb = {"loadBalancer": {"ingress": [{"ip": "192.0.2.7"}]}}
        out = await client.patch_status(f"/api/v1/namespaces/{ns}/services/s", lb)
        assert [i["ip"] for i in out["status"]["loadBalancer"]["ingress"]] == ["192.0.2.7"]
        seen = []
        params = {"resourceVersion": rv, "timeoutSeconds": "5"}
        async for event in client.watch("services", f"/api/v1/namespaces/{ns}/services", params):
            seen.append(event["type"])
            if len(seen) == 2:
                break
        assert seen == ["ADDED", "MODIFIED"]
        assert client.objects_received["services"] == 2
        # list, apply (Service is in kpx_kube's table: no discovery), status patch, watch
        assert client.requests_sent == 4 and client.connections_opened >= 1

    run(cluster, scenario)


def test_the_blocking_client_and_its_batches(cluster: Cluster, ns: str) -> None:
    base = f"/api/v1/namespaces/{ns}/configmaps"

    def create(name: str) -> Callable[[Client], Awaitable[dict[str, Any]]]:
        return lambda client: client.create(base, configmap(ns, name))

    with BlockingClient(from_kubeconfig(cluster.kubeconfig), connections=4) as kube:
        made = kube.many([create(f"m{i}") for i in range(20)], concurrency=4)
        assert [m["metadata"]["name"] for m in made] == [f"m{i}" for i in range(20)]
        assert kube.client.connections_opened <= 4
        # (the controller-manager publishes kube-root-ca.crt in every namespace, at any time)
        names = {c["metadata"]["name"] for c in kube.get(base)["items"]} - {"kube-root-ca.crt"}
        assert names == {f"m{i}" for i in range(20)}
        with pytest.raises(AlreadyExists):
            kube.many([create("m0")])
        with pytest.raises(NotFound):
            kube.get(f"{base}/none")


def test_answers_that_are_not_json_are_errors_that_say_so(cluster: Cluster) -> None:
    """The apiserver answers some paths with plain text: /livez (200 "ok") and a path it does
    not serve (404 "404 page not found"). A 200 that is not JSON is an ApiError BadResponse
    naming the request, a refusal that is not a Status is its typed error with the text."""
    from kpx_kube import ApiError

    async def livez(client: Client) -> Any:
        return await client.get("/livez")

    with pytest.raises(ApiError) as not_json:
        run(cluster, livez)
    assert (not_json.value.status, not_json.value.reason) == (200, "BadResponse")
    assert "GET /livez: not JSON" in str(not_json.value)

    async def nowhere(client: Client) -> Any:
        return await client.get("/no-such-path")

    with pytest.raises(NotFound, match=r"/no-such-path: 404 page not found"):
        run(cluster, nowhere)


def test_a_request_past_its_timeout_is_unreachable_not_a_hang(cluster: Cluster) -> None:
    """A request the apiserver holds open longer than the client's timeout (a watch of 60 s,
    a timeout of 1 s) ends as Unreachable (status 0) naming the request, which callers retry."""

    async def held(client: Client) -> Any:
        params = {"watch": "1", "timeoutSeconds": "60"}
        return await client.request("GET", "/api/v1/namespaces", params=params, timeout=1.0)

    with pytest.raises(Unreachable, match=r"GET /api/v1/namespaces.*Timeout") as late:
        run(cluster, held)
    assert late.value.status == 0
