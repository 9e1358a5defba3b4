"""model.types (the in-process node-local model) -> kpx.localstate.v1 protobuf messages, and back.

The one place that knows both shapes. `FIELDS` names, for every model.types type, the proto field
each of its fields becomes (`SERVED_WITHIN`: a field served inside other messages): a unit test
fails when a model.types type gains a field this module does not map, so a new field of the model
is never silently missing from the API.
"""

from __future__ import annotations

from ipaddress import ip_network
from typing import Any, Final

from kpx_localstate_client import localstate_pb2 as pb

from ..model.types import (
    IP,
    READY,
    DataplaneSettings,
    DetectLocal,
    DetectLocalMode,
    Endpoint,
    EndpointConditions,
    IPNetwork,
    IPVSOptions,
    LocalPods,
    NodeFacts,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortKey,
)

#: model.types type -> {its field: proto field}.
FIELDS: Final[dict[type, dict[str, str]]] = {
    ServicePortKey: {
        "namespace": "namespace",
        "name": "name",
        "port_name": "port_name",
        "protocol": "protocol",
        "family": "family",
    },
    Endpoint: {"ip": "ip", "port": "port", "local": "local"},
    # Served as fields of each Endpoint message (see SERVED_WITHIN).
    EndpointConditions: {"ready": "ready", "serving": "serving", "terminating": "terminating"},
    ServicePort: {
        "key": "key",
        "port": "port",
        "cluster_ips": "cluster_ips",
        "external_ips": "external_ips",
        "load_balancer_ips": "load_balancer_ips",
        "node_port": "node_port",
        "cluster_endpoints": "cluster_endpoints",
        "external_endpoints": "external_endpoints",
        "external_masquerade": "external_masquerade",
        "drop_when_no_cluster_endpoints": "drop_when_no_cluster_endpoints",
        "drop_when_no_external_endpoints": "drop_when_no_external_endpoints",
        "affinity_timeout": "affinity_timeout_seconds",
        "load_balancer_source_ranges": "load_balancer_source_ranges",
        "load_balancer_closed": "load_balancer_closed",
        "health_check_node_port": "health_check_node_port",
        "short_circuit_endpoints": "short_circuit_endpoints",
    },
    NodeInfo: {"name": "name", "addresses": "addresses", "zone": "zone", "pod_cidrs": "pod_cidrs"},
    DetectLocal: {"mode": "mode", "interface": "interface"},
    DataplaneSettings: {
        "masquerade_bit": "masquerade_bit",
        "masquerade_all": "masquerade_all",
        "cluster_cidrs": "cluster_cidrs",
        "node_port_networks": "node_port_networks",
        "detect_local": "detect_local",
        "localhost_node_ports": "localhost_node_ports",
        "conntrack_tcp_be_liberal": "conntrack_tcp_be_liberal",
    },
    NodeFacts: {
        "family": "family",
        "nodeport_networks": "node_port_networks",
        "local_pods": "local_pods",
        "localhost_node_ports": "localhost_node_ports",
    },
    LocalPods: {
        "networks": "networks",
        "interface": "interface",
        "interface_prefix": "interface_prefix",
    },
}

#: model.types type -> proto message it is served as (when not the message of the same name).
MESSAGES: Final[dict[type, str]] = {
    EndpointConditions: "Endpoint",
    DataplaneSettings: "ProxySettings",  # the state API's name (localstate.proto)
}

#: Fields served inside other messages rather than as a field of their own, each with where.
SERVED_WITHIN: Final[dict[type, dict[str, str]]] = {
    ServicePort: {
        "endpoint_conditions": "Endpoint.ready, .serving and .terminating of each endpoint in "
        "cluster_endpoints, external_endpoints and short_circuit_endpoints",
    },
}

#: Fields of served types that the state API does not serve, each with why: a decision, not
#: an omission (the unit test accepts a field only if it is mapped or listed here).
NOT_SERVED: Final[dict[type, dict[str, str]]] = {
    DataplaneSettings: {
        "ipvs": "the ipvs backend's own tuning (scheduler, IPVS timeouts, strictARP, "
        "excludeCIDRs): an out-of-tree backend is not IPVS",
        "external_ip_networks": "applied by the model: ServicePort.external_ips holds only "
        "the addresses it allows",
    },
}
#: model.types types the state API does not serve, each with why.
NOT_SERVED_TYPES: Final[dict[type, str]] = {
    IPVSOptions: "DataplaneSettings.ipvs (above)",
}

_PROTOCOL: Final = {Protocol.TCP: pb.TCP, Protocol.UDP: pb.UDP, Protocol.SCTP: pb.SCTP}
_PROTOCOL_BACK: Final = {v: k for k, v in _PROTOCOL.items()}
_DETECT: Final = {
    DetectLocalMode.CLUSTER_CIDR: pb.CLUSTER_CIDR,
    DetectLocalMode.NODE_CIDR: pb.NODE_CIDR,
    DetectLocalMode.BRIDGE_INTERFACE: pb.BRIDGE_INTERFACE,
    DetectLocalMode.INTERFACE_NAME_PREFIX: pb.INTERFACE_NAME_PREFIX,
}
_DETECT_BACK: Final = {v: k for k, v in _DETECT.items()}


def key_to_proto(key: ServicePortKey) -> pb.ServicePortKey:
    return pb.ServicePortKey(
        namespace=key.namespace,
        name=key.name,
        port_name=key.port_name,
        protocol=_PROTOCOL[key.protocol],
        family=key.family,
    )


def _endpoints(
    endpoints: tuple[Endpoint, ...], unusual: dict[str, EndpointConditions]
) -> list[pb.Endpoint]:
    if not unusual:  # the usual case: every endpoint plainly ready
        return [
            pb.Endpoint(ip=e.ip, port=e.port, local=e.local, ready=True, serving=True)
            for e in endpoints
        ]
    out = []
    for e in endpoints:
        c = unusual.get(e.ip, READY)
        out.append(
            pb.Endpoint(
                ip=e.ip,
                port=e.port,
                local=e.local,
                ready=c.ready,
                serving=c.serving,
                terminating=c.terminating,
            )
        )
    return out


def port_to_proto(port: ServicePort) -> pb.ServicePort:
    unusual = dict(port.endpoint_conditions)
    return pb.ServicePort(
        key=key_to_proto(port.key),
        port=port.port,
        cluster_ips=port.cluster_ips,
        external_ips=port.external_ips,
        load_balancer_ips=port.load_balancer_ips,
        node_port=port.node_port,
        cluster_endpoints=_endpoints(port.cluster_endpoints, unusual),
        external_endpoints=_endpoints(port.external_endpoints, unusual),
        external_masquerade=port.external_masquerade,
        drop_when_no_cluster_endpoints=port.drop_when_no_cluster_endpoints,
        drop_when_no_external_endpoints=port.drop_when_no_external_endpoints,
        affinity_timeout_seconds=port.affinity_timeout,
        load_balancer_source_ranges=[str(n) for n in port.load_balancer_source_ranges],
        load_balancer_closed=port.load_balancer_closed,
        health_check_node_port=port.health_check_node_port,
        short_circuit_endpoints=_endpoints(port.short_circuit_endpoints, unusual),
    )


def node_to_proto(node: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        name=node.name,
        addresses=node.addresses,
        zone=node.zone,
        pod_cidrs=[str(n) for n in node.pod_cidrs],
    )


def settings_to_proto(settings: DataplaneSettings) -> pb.ProxySettings:
    return pb.ProxySettings(
        masquerade_bit=settings.masquerade_bit,
        masquerade_all=settings.masquerade_all,
        cluster_cidrs=[str(n) for n in settings.cluster_cidrs],
        node_port_networks=[str(n) for n in settings.node_port_networks],
        detect_local=pb.DetectLocal(
            mode=_DETECT[settings.detect_local.mode], interface=settings.detect_local.interface
        ),
        localhost_node_ports=settings.localhost_node_ports,
        conntrack_tcp_be_liberal=settings.conntrack_tcp_be_liberal,
    )


def _networks(nets: tuple[IPNetwork, ...]) -> list[str]:
    return [str(n) for n in nets]


def facts_to_proto(facts: NodeFacts) -> pb.NodeFacts:
    msg = pb.NodeFacts(
        family=facts.family,
        local_pods=pb.LocalPods(
            networks=_networks(facts.local_pods.networks),
            interface=facts.local_pods.interface,
            interface_prefix=facts.local_pods.interface_prefix,
        ),
        localhost_node_ports=facts.localhost_node_ports,
    )
    if facts.nodeport_networks is not None:  # None: absent (every local address)
        msg.node_port_networks.SetInParent()
        msg.node_port_networks.cidrs.extend(_networks(facts.nodeport_networks))
    return msg


# -- back (tests, and plugins written against the node-local model) ------------------------------
def key_from_proto(msg: pb.ServicePortKey) -> ServicePortKey:
    return ServicePortKey(
        msg.namespace, msg.name, msg.port_name, _PROTOCOL_BACK[msg.protocol], msg.family
    )


def _endpoints_back(msgs: Any) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(IP.of(e.ip), e.port, e.local) for e in msgs)


def _conditions_back(*lists: Any) -> tuple[tuple[IP, EndpointConditions], ...]:
    unusual = {}
    for msgs in lists:
        for e in msgs:
            conditions = EndpointConditions(e.ready, e.serving, e.terminating)
            if conditions != READY:
                unusual[IP.of(e.ip)] = conditions
    return tuple(sorted(unusual.items()))


def _ips(values: Any) -> tuple[IP, ...]:
    return tuple(IP.of(v) for v in values)


def port_from_proto(msg: pb.ServicePort) -> ServicePort:
    return ServicePort(
        key=key_from_proto(msg.key),
        port=msg.port,
        cluster_ips=_ips(msg.cluster_ips),
        external_ips=_ips(msg.external_ips),
        load_balancer_ips=_ips(msg.load_balancer_ips),
        node_port=msg.node_port,
        cluster_endpoints=_endpoints_back(msg.cluster_endpoints),
        external_endpoints=_endpoints_back(msg.external_endpoints),
        external_masquerade=msg.external_masquerade,
        drop_when_no_cluster_endpoints=msg.drop_when_no_cluster_endpoints,
        drop_when_no_external_endpoints=msg.drop_when_no_external_endpoints,
        affinity_timeout=msg.affinity_timeout_seconds,
        load_balancer_source_ranges=tuple(ip_network(n) for n in msg.load_balancer_source_ranges),
        load_balancer_closed=msg.load_balancer_closed,
        health_check_node_port=msg.health_check_node_port,
        short_circuit_endpoints=_endpoints_back(msg.short_circuit_endpoints),
        endpoint_conditions=_conditions_back(
            msg.cluster_endpoints, msg.external_endpoints, msg.short_circuit_endpoints
        ),
    )


def node_from_proto(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        name=msg.name,
        addresses=_ips(msg.addresses),
        zone=msg.zone,
        pod_cidrs=tuple(ip_network(n) for n in msg.pod_cidrs),
    )


def settings_from_proto(msg: pb.ProxySettings) -> DataplaneSettings:
    return DataplaneSettings(
        masquerade_bit=msg.masquerade_bit,
        masquerade_all=msg.masquerade_all,
        cluster_cidrs=tuple(ip_network(n) for n in msg.cluster_cidrs),
        node_port_networks=tuple(ip_network(n) for n in msg.node_port_networks),
        detect_local=DetectLocal(_DETECT_BACK[msg.detect_local.mode], msg.detect_local.interface),
        localhost_node_ports=msg.localhost_node_ports,
        conntrack_tcp_be_liberal=msg.conntrack_tcp_be_liberal,
    )


def facts_from_proto(msg: pb.NodeFacts) -> NodeFacts:
    pods = msg.local_pods
    return NodeFacts(
        family=msg.family,
        nodeport_networks=(
            tuple(ip_network(n) for n in msg.node_port_networks.cidrs)
            if msg.HasField("node_port_networks")
            else None
        ),
        local_pods=LocalPods(
            networks=tuple(ip_network(n) for n in pods.networks),
            interface=pods.interface,
            interface_prefix=pods.interface_prefix,
        ),
        localhost_node_ports=msg.localhost_node_ports,
    )
