"""The apiserver's own addresses reach the agents, so no agent needs a Service VIP to start."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from test_operator_reconciler import Events, FakeApi, body

from kpx_operator.apiserver import ApiError
from kpx_operator.apiserver_endpoints import endpoints_of
from kpx_operator.builders import BuildOptions
from kpx_operator.reconciler import OperatorConfig, Reconciler

NS = "kpx-system"


def kubernetes_slice(*addresses: str, ready: bool = True, port: int = 6443) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "addressType": "IPv4",
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a in addresses],
    }


def test_ready_addresses_on_the_https_port_sorted() -> None:
    assert endpoints_of(kubernetes_slice("192.0.2.11", "192.0.2.10")) == (
        "192.0.2.10:6443",
        "192.0.2.11:6443",
    )
    assert endpoints_of(kubernetes_slice("2001:db8::10")) == ("[2001:db8::10]:6443",)
    assert endpoints_of(kubernetes_slice("192.0.2.10", ready=False)) == ()
    # Nothing that is not an address, and not the apiserver's own loopback.
    assert endpoints_of(kubernetes_slice("127.0.0.1", "x; rm -rf /", "0.0.0.0")) == ()
    assert endpoints_of(kubernetes_slice("192.0.2.10", port=0)) == ()
    assert endpoints_of(None) == ()


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def agent_env(api: FakeApi) -> dict[str, str]:
    ds = api.objs[("DaemonSet", NS, "kpx-agent-default")]
    (container,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_the_agents_get_the_apiserver_addresses_and_keep_them_through_a_failed_read() -> None:
    api, clock = FakeApi(), Clock()
    api.objs[("EndpointSlice", "default", "kubernetes")] = kubernetes_slice("192.0.2.10")
    r = Reconciler(api, OperatorConfig(), clock=clock)

    def reconcile() -> None:
        asyncio.run(r.reconcile(body(), [], {}, Events()))

    reconcile()
    assert agent_env(api)["KPX_APISERVER_ENDPOINTS"] == "192.0.2.10:6443"
    # A new control-plane address is picked up after the refresh interval, not at every pass.
    api.objs[("EndpointSlice", "default", "kubernetes")] = kubernetes_slice("192.0.2.20")
    reconcile()
    assert agent_env(api)["KPX_APISERVER_ENDPOINTS"] == "192.0.2.10:6443"
    clock.now += timedelta(seconds=61)
    reconcile()
    assert agent_env(api)["KPX_APISERVER_ENDPOINTS"] == "192.0.2.20:6443"
    # A failed read keeps what was known: the agents' pod template does not flap.
    real_get = api.get

    async def refused(kind: str, name: str, namespace: str | None = None) -> Any:
        if kind == "EndpointSlice":
            raise ApiError("Forbidden")
        return await real_get(kind, name, namespace)

    api.get = refused  # type: ignore[method-assign]
    clock.now += timedelta(seconds=61)
    reconcile()
    assert agent_env(api)["KPX_APISERVER_ENDPOINTS"] == "192.0.2.20:6443"


def test_an_explicit_endpoint_wins_and_is_not_looked_up() -> None:
    api = FakeApi()
    api.objs[("EndpointSlice", "default", "kubernetes")] = kubernetes_slice("192.0.2.10")
    config = OperatorConfig(build=BuildOptions(apiserver_endpoint="198.51.100.1:6443"))
    asyncio.run(Reconciler(api, config).reconcile(body(), [], {}, Events()))
    env = agent_env(api)
    assert env["KUBERNETES_SERVICE_HOST"] == "198.51.100.1"
    assert "KPX_APISERVER_ENDPOINTS" not in env
