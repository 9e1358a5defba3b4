"""spec.externalIPs the model refuses (externalIPs.allowedCIDRs and its default): left out of
every backend's rules, reported; and the setting's way from the configuration to the model."""

from __future__ import annotations

from ipaddress import ip_network
from typing import Any

import pytest
from semantics import TCP, WORLD, Outcome, Packet

from kpx_agent.backends.base import Backend
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.model.external_ips import ExternalIPPolicy
from kpx_agent.model.service_problems import EXTERNAL_IP_REFUSED
from kpx_agent.model.types import IP, DataplaneSettings
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.settings import resolve
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import MODEL_PROBLEMS, Proxier
from kpx_api.agentconfig import AgentConfiguration
from kpx_api.proxysettings import NamespaceOptOut

NODE_IP = WORLD.node  # 10.242.0.1
APISERVER_IP = "10.242.0.100"
FREE_IP = "192.0.2.10"
ENDPOINT = "10.244.2.2"


def service(*external_ips: str, name: str = "web", vip: str = "10.96.0.10") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "a", "name": name},
        "spec": {
            "clusterIPs": [vip],
            "ports": [{"port": 80, "protocol": "TCP"}],
            "externalIPs": list(external_ips),
        },
    }


def endpoints(ns: str, svc: str, ip: str, port: int = 8080) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": ns,
            "name": f"{svc}-1",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "ports": [{"port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": "n2"}],
    }


def node(*addresses: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "n1"},
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def nft() -> tuple[Any, Any]:
    fake = FakeNftables()
    return NftablesBackend(DataplaneSettings(), fake), fake


def ipt() -> tuple[Any, Any]:
    fake = FakeIptables()
    return IptablesBackend(DataplaneSettings(), fake, ensure_sysctl=lambda path, value: None), fake


def proxier_with(backend: Any) -> tuple[ClusterState, Proxier]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    proxier.delete_flows = lambda flows: 0
    return state, proxier


def from_outside(daddr: str) -> Packet:
    return Packet(
        4, WORLD.ext, daddr, TCP, 80, "external", WORLD.fabric, frozenset({NODE_IP, "127.0.0.1"})
    )


TAKEN = {Outcome("accept", (ENDPOINT, 8080), True)}
UNTOUCHED = {Outcome("accept")}


@pytest.mark.parametrize("make", [nft, ipt], ids=["nftables", "iptables"])
def test_the_nodes_own_address_is_not_taken_by_default(make: Any) -> None:
    backend, fake = make()
    state, proxier = proxier_with(backend)
    state.upsert(NODES, node(NODE_IP))
    state.upsert(SERVICES, service(NODE_IP, FREE_IP))
    state.upsert(SLICES, endpoints("a", "web", ENDPOINT))
    assert proxier.sync().ok
    assert fake.trace(from_outside(FREE_IP)) == TAKEN
    assert fake.trace(from_outside(NODE_IP)) == UNTOUCHED


@pytest.mark.parametrize("make", [nft, ipt], ids=["nftables", "iptables"])
def test_the_apiservers_address_is_not_taken_by_default(make: Any) -> None:
    backend, fake = make()
    state, proxier = proxier_with(backend)
    state.upsert(
        SERVICES,
        {
            "metadata": {"namespace": "default", "name": "kubernetes"},
            "spec": {"clusterIPs": ["10.96.0.1"], "ports": [{"port": 443, "protocol": "TCP"}]},
        },
    )
    state.upsert(SLICES, endpoints("default", "kubernetes", APISERVER_IP, 80))
    state.upsert(SERVICES, service(APISERVER_IP))
    state.upsert(SLICES, endpoints("a", "web", ENDPOINT))
    assert proxier.sync().ok
    assert fake.trace(from_outside(APISERVER_IP)) == UNTOUCHED


@pytest.mark.parametrize("make", [nft, ipt], ids=["nftables", "iptables"])
def test_an_allow_list_takes_only_addresses_inside_it(make: Any) -> None:
    backend, fake = make()
    backend.settings = DataplaneSettings(external_ip_networks=(ip_network("192.0.2.0/28"),))
    state, proxier = proxier_with(backend)
    state.upsert(SERVICES, service(FREE_IP, "198.51.100.7", "127.0.0.1"))
    state.upsert(SLICES, endpoints("a", "web", ENDPOINT))
    assert proxier.sync().ok
    assert fake.trace(from_outside(FREE_IP)) == TAKEN
    assert fake.trace(from_outside("198.51.100.7")) == UNTOUCHED
    [port] = proxier.local.services.values()
    assert port.external_ips == (IP.of(FREE_IP),)


# --- the policy and its reports -----------------------------------------------------------------

DEFAULT = ExternalIPPolicy(
    node_addresses=frozenset({IP.of(NODE_IP)}), apiserver_addresses=frozenset({IP.of(APISERVER_IP)})
)
LISTED = ExternalIPPolicy(
    allowed=(ip_network("10.242.0.0/24"), ip_network("2001:db8::/64")),
    node_addresses=frozenset({IP.of(NODE_IP)}),
)


@pytest.mark.parametrize(
    ("policy", "address", "refused"),
    [
        (DEFAULT, FREE_IP, None),
        (DEFAULT, "2001:db8::7", None),
        (DEFAULT, NODE_IP, "an address of this node"),
        (DEFAULT, APISERVER_IP, "an address of the apiserver"),
        (DEFAULT, "127.0.0.1", "a loopback address"),
        (DEFAULT, "::1", "a loopback address"),
        (DEFAULT, "0.0.0.0", "an unspecified address"),
        (DEFAULT, "169.254.169.254", "a link-local address"),
        (DEFAULT, "fe80::1", "a link-local address"),
        (DEFAULT, "224.0.0.1", "a multicast address"),
        (LISTED, NODE_IP, None),  # listed: the list decides
        (LISTED, "2001:db8::7", None),
        (LISTED, FREE_IP, "outside externalIPs.allowedCIDRs"),
        (LISTED, "127.0.0.1", "a loopback address"),
    ],
)
def test_policy(policy: ExternalIPPolicy, address: str, refused: str | None) -> None:
    why = policy.refusal(IP.of(address))
    assert why == refused if refused is None else refused in (why or "")


class NullBackend(Backend):
    mode = "test"

    def __init__(self) -> None:
        self.settings = DataplaneSettings()

    def sync(self, state: object, changed: object) -> None:
        pass

    def cleanup(self) -> None:
        pass

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings


def external_ips(proxier: Proxier) -> dict[str, list[str]]:
    return {k.name: list(p.external_ips) for k, p in proxier.local.services.items()}


def test_refused_addresses_are_reported_and_follow_the_node_and_the_settings() -> None:
    backend = NullBackend()
    state, proxier = proxier_with(backend)
    state.upsert(SERVICES, service(NODE_IP, FREE_IP, "127.0.0.1"))
    state.upsert(SERVICES, service(name="plain", vip="10.96.0.11"))
    proxier.sync()
    # The node's addresses are not known yet: only the loopback address is refused.
    assert external_ips(proxier) == {"web": [NODE_IP, FREE_IP], "plain": []}
    assert [p.message for p in proxier.problems.of(MODEL_PROBLEMS)] == [
        "externalIP 127.0.0.1 is not programmed: it is a loopback address"
    ]
    state.upsert(NODES, node(NODE_IP))
    outcome = proxier.sync()
    assert external_ips(proxier)["web"] == [FREE_IP]
    assert outcome.changed_ports == 1  # only the Service with externalIPs was recomputed
    problems = proxier.problems.of(MODEL_PROBLEMS)
    assert {(p.name, p.reason) for p in problems} == {("web", EXTERNAL_IP_REFUSED)}
    assert any(NODE_IP in p.message for p in problems)
    # An allow-list holding the node's network: the list decides.
    proxier.reconfigure(DataplaneSettings(external_ip_networks=(ip_network("10.242.0.0/16"),)))
    assert backend.settings == proxier.settings  # the backend is told, too
    proxier.sync()
    assert external_ips(proxier)["web"] == [NODE_IP]


def test_allowed_cidrs_travel_from_the_configuration_to_the_model() -> None:
    config = AgentConfiguration.model_validate(
        {"mode": "nftables", "externalIPs": {"allowedCIDRs": ["192.0.2.0/24", "2001:db8::/64"]}}
    )
    assert resolve(config).proxy.external_ip_networks == (
        ip_network("192.0.2.0/24"),
        ip_network("2001:db8::/64"),
    )
    assert resolve(AgentConfiguration(mode="nftables")).proxy.external_ip_networks == ()
