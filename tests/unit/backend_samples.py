"""The node-local state every backend's golden tests render, and the golden-file check."""

from __future__ import annotations

import dataclasses
import os
from ipaddress import ip_network
from pathlib import Path
from typing import NamedTuple

from kpx_agent.model.service_ports import local_state
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)

GOLDEN = Path(__file__).parent / "golden"
SETTINGS = DataplaneSettings(
    cluster_cidrs=(ip_network("10.244.0.0/16"), ip_network("fd00:244::/48"))
)
NODE = NodeInfo("n1", addresses=(IP.of("10.242.0.1"), IP.of("fd00:242::1")))


def key(name: str, family: int = 4, proto: Protocol = Protocol.TCP) -> ServicePortKey:
    return ServicePortKey("default", name, "http", proto, family)


def endpoints(*ips: str, local: str = "") -> tuple[Endpoint, ...]:
    return tuple(Endpoint(IP.of(i), 8080, i == local) for i in ips)


def sample_state(settings: DataplaneSettings = SETTINGS, node: NodeInfo = NODE) -> NodeLocalState:
    """One Service port per behaviour a backend renders."""
    eps = endpoints("10.244.1.2", "10.244.2.2", local="10.244.1.2")
    services = [
        ServicePort(
            key("web"),
            80,
            cluster_ips=(IP.of("10.96.0.10"),),
            cluster_endpoints=eps,
            external_endpoints=eps,
        ),
        ServicePort(
            key("dns", proto=Protocol.UDP),
            53,
            cluster_ips=(IP.of("10.96.0.53"),),
            cluster_endpoints=eps[:1],
            external_endpoints=eps[:1],
        ),
        ServicePort(key("empty"), 80, cluster_ips=(IP.of("10.96.0.11"),)),
        ServicePort(
            key("np"),
            80,
            cluster_ips=(IP.of("10.96.0.12"),),
            node_port=30080,
            external_ips=(IP.of("192.0.2.10"),),
            load_balancer_ips=(IP.of("192.0.2.20"),),
            cluster_endpoints=eps,
            external_endpoints=eps,
        ),
        ServicePort(
            key("local"),
            80,
            cluster_ips=(IP.of("10.96.0.13"),),
            node_port=30081,
            load_balancer_ips=(IP.of("192.0.2.21"),),
            cluster_endpoints=eps,
            external_endpoints=(),
            external_masquerade=False,
            drop_when_no_external_endpoints=True,
            short_circuit_endpoints=eps,
        ),
        ServicePort(
            key("web6", family=6),
            80,
            cluster_ips=(IP.of("fd00:96::10"),),
            cluster_endpoints=endpoints("fd00:244:1::2"),
            external_endpoints=endpoints("fd00:244:1::2"),
        ),
        ServicePort(
            key("sticky"),
            80,
            cluster_ips=(IP.of("10.96.0.14"),),
            cluster_endpoints=eps,
            external_endpoints=eps,
            affinity_timeout=10800,
        ),
        ServicePort(
            key("fw"),
            443,
            cluster_ips=(IP.of("10.96.0.15"),),
            load_balancer_ips=(IP.of("192.0.2.30"),),
            load_balancer_source_ranges=(ip_network("198.51.100.0/24"),),
            cluster_endpoints=eps,
            external_endpoints=eps[1:],
        ),
    ]
    return local_state(node, settings, services)


def check_golden(path: Path, text: str) -> None:
    """`text` must equal the reviewed golden file; KPX_UPDATE_GOLDEN=1 rewrites it."""
    if os.environ.get("KPX_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; review and set KPX_UPDATE_GOLDEN=1"


class RicherEndpoint(NamedTuple):
    """An endpoint that carries more than address, port and locality (as the model's may:
    readiness conditions, hints): a backend must render it exactly as the plain one."""

    ip: IP
    port: int
    local: bool = False
    serving: bool = True
    terminating: bool = False
    zone: str = "zone-a"


def with_richer_endpoints(state: NodeLocalState) -> NodeLocalState:
    """The same state with every endpoint a `RicherEndpoint`."""

    def richer(eps: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        return tuple(RicherEndpoint(e.ip, e.port, e.local) for e in eps)  # type: ignore[misc]

    services = {
        k: dataclasses.replace(
            sp,
            cluster_endpoints=richer(sp.cluster_endpoints),
            external_endpoints=richer(sp.external_endpoints),
            short_circuit_endpoints=richer(sp.short_circuit_endpoints),
        )
        for k, sp in state.services.items()
    }
    return dataclasses.replace(state, services=services)
