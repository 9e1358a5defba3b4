from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Protocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_UNSPECIFIED: _ClassVar[Protocol]
    TCP: _ClassVar[Protocol]
    UDP: _ClassVar[Protocol]
    SCTP: _ClassVar[Protocol]

class DetectLocalMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DETECT_LOCAL_MODE_UNSPECIFIED: _ClassVar[DetectLocalMode]
    CLUSTER_CIDR: _ClassVar[DetectLocalMode]
    NODE_CIDR: _ClassVar[DetectLocalMode]
    BRIDGE_INTERFACE: _ClassVar[DetectLocalMode]
    INTERFACE_NAME_PREFIX: _ClassVar[DetectLocalMode]
PROTOCOL_UNSPECIFIED: Protocol
TCP: Protocol
UDP: Protocol
SCTP: Protocol
DETECT_LOCAL_MODE_UNSPECIFIED: DetectLocalMode
CLUSTER_CIDR: DetectLocalMode
NODE_CIDR: DetectLocalMode
BRIDGE_INTERFACE: DetectLocalMode
INTERFACE_NAME_PREFIX: DetectLocalMode

class WatchRequest(_message.Message):
    __slots__ = ("instance_id", "revision", "want_deltas")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    WANT_DELTAS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    revision: int
    want_deltas: bool
    def __init__(self, instance_id: _Optional[str] = ..., revision: _Optional[int] = ..., want_deltas: _Optional[bool] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("instance_id", "revision", "full", "node", "settings", "service_ports", "deleted", "node_facts")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_PORTS_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    NODE_FACTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    revision: int
    full: bool
    node: NodeInfo
    settings: ProxySettings
    service_ports: _containers.RepeatedCompositeFieldContainer[ServicePort]
    deleted: _containers.RepeatedCompositeFieldContainer[ServicePortKey]
    node_facts: _containers.RepeatedCompositeFieldContainer[NodeFacts]
    def __init__(self, instance_id: _Optional[str] = ..., revision: _Optional[int] = ..., full: _Optional[bool] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ..., settings: _Optional[_Union[ProxySettings, _Mapping]] = ..., service_ports: _Optional[_Iterable[_Union[ServicePort, _Mapping]]] = ..., deleted: _Optional[_Iterable[_Union[ServicePortKey, _Mapping]]] = ..., node_facts: _Optional[_Iterable[_Union[NodeFacts, _Mapping]]] = ...) -> None: ...

class ServicePortKey(_message.Message):
    __slots__ = ("namespace", "name", "port_name", "protocol", "family")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PORT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    port_name: str
    protocol: Protocol
    family: int
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., port_name: _Optional[str] = ..., protocol: _Optional[_Union[Protocol, str]] = ..., family: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("ip", "port", "local", "ready", "serving", "terminating")
    IP_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    ip: str
    port: int
    local: bool
    ready: bool
    serving: bool
    terminating: bool
    def __init__(self, ip: _Optional[str] = ..., port: _Optional[int] = ..., local: _Optional[bool] = ..., ready: _Optional[bool] = ..., serving: _Optional[bool] = ..., terminating: _Optional[bool] = ...) -> None: ...

class ServicePort(_message.Message):
    __slots__ = ("key", "port", "cluster_ips", "external_ips", "load_balancer_ips", "node_port", "cluster_endpoints", "external_endpoints", "external_masquerade", "drop_when_no_cluster_endpoints", "drop_when_no_external_endpoints", "affinity_timeout_seconds", "load_balancer_source_ranges", "health_check_node_port", "short_circuit_endpoints", "load_balancer_closed")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IPS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_IPS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCER_IPS_FIELD_NUMBER: _ClassVar[int]
    NODE_PORT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_MASQUERADE_FIELD_NUMBER: _ClassVar[int]
    DROP_WHEN_NO_CLUSTER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    DROP_WHEN_NO_EXTERNAL_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCER_SOURCE_RANGES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_CHECK_NODE_PORT_FIELD_NUMBER: _ClassVar[int]
    SHORT_CIRCUIT_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCER_CLOSED_FIELD_NUMBER: _ClassVar[int]
    key: ServicePortKey
    port: int
    cluster_ips: _containers.RepeatedScalarFieldContainer[str]
    external_ips: _containers.RepeatedScalarFieldContainer[str]
    load_balancer_ips: _containers.RepeatedScalarFieldContainer[str]
    node_port: int
    cluster_endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    external_endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    external_masquerade: bool
    drop_when_no_cluster_endpoints: bool
    drop_when_no_external_endpoints: bool
    affinity_timeout_seconds: int
    load_balancer_source_ranges: _containers.RepeatedScalarFieldContainer[str]
    health_check_node_port: int
    short_circuit_endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    load_balancer_closed: bool
    def __init__(self, key: _Optional[_Union[ServicePortKey, _Mapping]] = ..., port: _Optional[int] = ..., cluster_ips: _Optional[_Iterable[str]] = ..., external_ips: _Optional[_Iterable[str]] = ..., load_balancer_ips: _Optional[_Iterable[str]] = ..., node_port: _Optional[int] = ..., cluster_endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., external_endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., external_masquerade: _Optional[bool] = ..., drop_when_no_cluster_endpoints: _Optional[bool] = ..., drop_when_no_external_endpoints: _Optional[bool] = ..., affinity_timeout_seconds: _Optional[int] = ..., load_balancer_source_ranges: _Optional[_Iterable[str]] = ..., health_check_node_port: _Optional[int] = ..., short_circuit_endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., load_balancer_closed: _Optional[bool] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "addresses", "zone", "pod_cidrs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    POD_CIDRS_FIELD_NUMBER: _ClassVar[int]
    name: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    zone: str
    pod_cidrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., zone: _Optional[str] = ..., pod_cidrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetectLocal(_message.Message):
    __slots__ = ("mode", "interface")
    MODE_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    mode: DetectLocalMode
    interface: str
    def __init__(self, mode: _Optional[_Union[DetectLocalMode, str]] = ..., interface: _Optional[str] = ...) -> None: ...

class Networks(_message.Message):
    __slots__ = ("cidrs",)
    CIDRS_FIELD_NUMBER: _ClassVar[int]
    cidrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cidrs: _Optional[_Iterable[str]] = ...) -> None: ...

class LocalPods(_message.Message):
    __slots__ = ("networks", "interface", "interface_prefix")
    NETWORKS_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    networks: _containers.RepeatedScalarFieldContainer[str]
    interface: str
    interface_prefix: str
    def __init__(self, networks: _Optional[_Iterable[str]] = ..., interface: _Optional[str] = ..., interface_prefix: _Optional[str] = ...) -> None: ...

class NodeFacts(_message.Message):
    __slots__ = ("family", "node_port_networks", "local_pods", "localhost_node_ports")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NODE_PORT_NETWORKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PODS_FIELD_NUMBER: _ClassVar[int]
    LOCALHOST_NODE_PORTS_FIELD_NUMBER: _ClassVar[int]
    family: int
    node_port_networks: Networks
    local_pods: LocalPods
    localhost_node_ports: bool
    def __init__(self, family: _Optional[int] = ..., node_port_networks: _Optional[_Union[Networks, _Mapping]] = ..., local_pods: _Optional[_Union[LocalPods, _Mapping]] = ..., localhost_node_ports: _Optional[bool] = ...) -> None: ...

class ProxySettings(_message.Message):
    __slots__ = ("masquerade_bit", "masquerade_all", "cluster_cidrs", "node_port_networks", "detect_local", "localhost_node_ports", "conntrack_tcp_be_liberal")
    MASQUERADE_BIT_FIELD_NUMBER: _ClassVar[int]
    MASQUERADE_ALL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_CIDRS_FIELD_NUMBER: _ClassVar[int]
    NODE_PORT_NETWORKS_FIELD_NUMBER: _ClassVar[int]
    DETECT_LOCAL_FIELD_NUMBER: _ClassVar[int]
    LOCALHOST_NODE_PORTS_FIELD_NUMBER: _ClassVar[int]
    CONNTRACK_TCP_BE_LIBERAL_FIELD_NUMBER: _ClassVar[int]
    masquerade_bit: int
    masquerade_all: bool
    cluster_cidrs: _containers.RepeatedScalarFieldContainer[str]
    node_port_networks: _containers.RepeatedScalarFieldContainer[str]
    detect_local: DetectLocal
    localhost_node_ports: bool
    conntrack_tcp_be_liberal: bool
    def __init__(self, masquerade_bit: _Optional[int] = ..., masquerade_all: _Optional[bool] = ..., cluster_cidrs: _Optional[_Iterable[str]] = ..., node_port_networks: _Optional[_Iterable[str]] = ..., detect_local: _Optional[_Union[DetectLocal, _Mapping]] = ..., localhost_node_ports: _Optional[bool] = ..., conntrack_tcp_be_liberal: _Optional[bool] = ...) -> None: ...
