"""Stale UDP conntrack deletions, and healthCheckNodePort answers (pure parts). Which entries
each filter matches: test_conntrack_netlink.py."""

from __future__ import annotations

import json

from kpx_agent.conntrack.stale_flows import FlowFilter, stale_flows
from kpx_agent.model.types import (
    IP,
    Endpoint,
    EndpointConditions,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)
from kpx_agent.observability.service_health import HealthTarget, health_targets, response

VIP, EP1, EP2 = IP.of("10.96.0.53"), IP.of("10.244.1.2"), IP.of("10.244.2.2")


def dns(*eps: Endpoint, node_port: int = 0, proto: Protocol = Protocol.UDP) -> ServicePort:
    return ServicePort(
        ServicePortKey("kube-system", "dns", "dns", proto, 4),
        53,
        cluster_ips=(VIP,),
        node_port=node_port,
        cluster_endpoints=eps,
        external_endpoints=eps,
    )


def test_removed_endpoint_deletes_flows_dnated_to_it() -> None:
    old = dns(Endpoint(EP1, 5353), Endpoint(EP2, 5353), node_port=30053)
    new = dns(Endpoint(EP2, 5353), node_port=30053)
    assert stale_flows(old, new) == [
        FlowFilter(4, 53, VIP, EP1, dnat_port=5353),
        FlowFilter(4, 30053, None, EP1, dnat_port=5353),
    ]


def test_target_port_change_on_the_same_pod_deletes_the_flows_to_the_old_port() -> None:
    """The same pod behind another targetPort is another endpoint (sig-network's "Conntrack
    should be able to cleanup conntrack entries when UDP service target port changes")."""
    old = dns(Endpoint(EP1, 5353), node_port=30053)
    new = dns(Endpoint(EP1, 6363), node_port=30053)
    assert stale_flows(old, new) == [
        FlowFilter(4, 53, VIP, EP1, dnat_port=5353),
        FlowFilter(4, 30053, None, EP1, dnat_port=5353),
    ]


def test_zero_to_some_endpoints_deletes_the_flows_to_the_vip_that_were_not_dnated() -> None:
    assert stale_flows(dns(), dns(Endpoint(EP1, 5353))) == [FlowFilter(4, 53, VIP, not_nated=True)]
    # An agent's start (nothing known before): a live flow DNATed to an endpoint stays.
    new = dns(Endpoint(EP1, 5353), node_port=30053)
    assert stale_flows(None, new) == [
        FlowFilter(4, 53, VIP, not_nated=True),
        FlowFilter(4, 30053, None, not_nated=True),
    ]


def test_deleted_service_and_unchanged_and_tcp() -> None:
    assert stale_flows(dns(Endpoint(EP1, 5353)), None) == [
        FlowFilter(4, 53, VIP, EP1, dnat_port=5353)
    ]
    assert stale_flows(dns(Endpoint(EP1, 5353)), dns(Endpoint(EP1, 5353))) == []
    tcp = dns(Endpoint(EP1, 5353), proto=Protocol.TCP)
    assert stale_flows(tcp, None) == []


def test_health_targets_count_local_external_endpoints() -> None:
    key = ServicePortKey("shop", "web", "http", Protocol.TCP, 4)
    local = Endpoint(EP1, 8080, local=True)
    sp = ServicePort(
        key,
        80,
        node_port=30080,
        external_endpoints=(local,),
        health_check_node_port=32000,
        external_masquerade=False,
    )
    key6 = ServicePortKey("shop", "web", "http", Protocol.TCP, 6)
    local6 = Endpoint(IP.of("fd00::2"), 8080, True)
    sp6 = ServicePort(key6, 80, health_check_node_port=32000, external_endpoints=(local6,))
    state = NodeLocalState(NodeInfo("n1"), {key: sp, key6: sp6})
    # One dual-stack pod: an address per family, one endpoint.
    assert health_targets(state) == {32000: HealthTarget("shop", "web", 1)}


def test_health_targets_count_only_ready_local_endpoints() -> None:
    """Only serving-terminating local endpoints (the fallback): 503, as upstream (sig-network's
    "should fail health check node port if there are only terminating endpoints")."""
    key = ServicePortKey("shop", "web", "http", Protocol.TCP, 4)
    terminating = EndpointConditions(ready=False, serving=True, terminating=True)
    sp = ServicePort(
        key,
        80,
        node_port=30080,
        external_endpoints=(Endpoint(EP1, 8080, True),),
        health_check_node_port=32000,
        external_masquerade=False,
        endpoint_conditions=((EP1, terminating),),
    )
    (target,) = health_targets(NodeLocalState(NodeInfo("n1"), {key: sp})).values()
    assert target == HealthTarget("shop", "web", 0)
    assert response(target)[0] == 503
    status, headers, body = response(HealthTarget("shop", "web", 2))
    assert status == 200 and headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert json.loads(body)["localEndpoints"] == 2
    assert response(HealthTarget("shop", "web", 0))[0] == 503


def test_tcp_and_sctp_ports_getting_endpoints_clean_only_their_cluster_ips_entries() -> None:
    """A TCP or SCTP entry to a ClusterIP that was not DNATed is never a live flow (nobody owns
    the address); at a NodePort or an external IP it may be one (the node's own listener)."""
    for proto, number in ((Protocol.TCP, 6), (Protocol.SCTP, 132)):
        new = dns(Endpoint(EP1, 5353), node_port=30053, proto=proto)
        assert stale_flows(dns(proto=proto), new) == [
            FlowFilter(4, 53, VIP, not_nated=True, proto=number)
        ]
        assert stale_flows(None, new) == [FlowFilter(4, 53, VIP, not_nated=True, proto=number)]
        assert stale_flows(None, dns(proto=proto)) == []  # no endpoints: refused, nothing
        assert stale_flows(new, dns(Endpoint(EP2, 5353), node_port=30053, proto=proto)) == []
