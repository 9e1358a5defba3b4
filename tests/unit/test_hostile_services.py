"""Hostile and random Services and EndpointSlices, through the whole agent path (issue #22,
"hostile and random input"): the store, the node-local model, the VIP claims, quarantine and the
nftables backend against its kernel fake.

Generated objects include what a validating apiserver refuses today but older clusters stored
(sloppy CIDRs, bad ports, unknown protocols), duplicate and clashing addresses across
Services, IPv6 in several spellings, names at their length limits, ports at the limits.

Properties:
- no sequence of adds, changes and deletes raises, and every sync succeeds with nothing the
  kernel refuses (what the agent renders always loads);
- the kernel after those partial syncs holds what one full sync of the final state gives a
  fresh agent (clashes and quarantine decided alike whatever the order of events), but for the
  maps of an endpoint count no port has any more (created on demand, `endpoints-N`: they stay,
  empty, until the next full sync).
"""

from __future__ import annotations

import re
from typing import Any

from backend_samples import SETTINGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import DATAPLANE, Proxier
from kpx_api.proxysettings import NamespaceOptOut

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NAMES = st.sampled_from(["a", "web", "x" * 63, "db-1"])
NAMESPACE = st.sampled_from(["default", "n" * 63])
V4 = ["10.96.0.10", "10.96.0.11", "010.96.0.12", "192.0.2.1", "10.244.1.2", "0.0.0.0", "x"]
V6 = ["fd00:96::10", "FD00:96:0::10", "fd00:96:0:0:0:0:0:10", "::ffff:10.96.0.10", "fd00::1"]
ADDRESSES = st.sampled_from(V4 + V6)
PORT_NUMBERS = st.sampled_from([0, 1, 53, 80, 443, 8080, 30080, 65535, 65536, -1, "80", None])
PROTOCOLS = st.sampled_from(["TCP", "UDP", "SCTP", "ICMP", None, 7])
TIMEOUTS = st.sampled_from([0, 1, 10800, 86400, 86401, "x", None])
RANGES = st.sampled_from(
    [
        "10.0.0.0/8",
        "10.1.0.0/16",
        "010.0.0.0/8",
        "::ffff:10.0.0.0/104",
        "0.0.0.0/0",
        "fd00::/8",
        "bogus",
        "192.0.2.0/33",
    ]
)


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    ips = draw(st.lists(ADDRESSES, max_size=3))
    ports = draw(
        st.lists(
            st.fixed_dictionaries(
                {"port": PORT_NUMBERS, "protocol": PROTOCOLS},
                optional={
                    "name": st.sampled_from(["http", "dns", "", "p" * 15]),
                    "nodePort": PORT_NUMBERS,
                    "targetPort": PORT_NUMBERS,
                },
            ),
            max_size=4,
        )
    )
    spec: dict[str, Any] = {
        "type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"])),
        "clusterIP": ips[0] if ips else draw(st.sampled_from(["None", "", None])),
        "clusterIPs": ips,
        "ports": ports,
        "externalIPs": draw(st.lists(ADDRESSES, max_size=3)),
        "loadBalancerSourceRanges": draw(st.lists(RANGES, max_size=3)),
        "externalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local", None, "x"])),
        "internalTrafficPolicy": draw(st.sampled_from(["Cluster", "Local", None])),
        "sessionAffinity": draw(st.sampled_from(["None", "ClientIP", None])),
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": draw(TIMEOUTS)}},
        "healthCheckNodePort": draw(PORT_NUMBERS),
    }
    ingress = [{"ip": ip} for ip in draw(st.lists(ADDRESSES, max_size=2))]
    return {
        "metadata": {
            "namespace": draw(NAMESPACE),
            "name": draw(NAMES),
            "creationTimestamp": draw(
                st.sampled_from(["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "garbage", None])
            ),
        },
        "spec": spec,
        "status": {"loadBalancer": {"ingress": ingress}},
    }


@st.composite
def slices(draw: st.DrawFn) -> dict[str, Any]:
    endpoints = draw(
        st.lists(
            st.fixed_dictionaries(
                {"addresses": st.lists(ADDRESSES, min_size=1, max_size=2)},
                optional={
                    "conditions": st.fixed_dictionaries(
                        {},
                        optional={
                            "ready": st.booleans(),
                            "serving": st.booleans(),
                            "terminating": st.booleans(),
                        },
                    ),
                    "nodeName": st.sampled_from(["n1", "n2"]),
                },
            ),
            max_size=5,
        )
    )
    return {
        "metadata": {
            "namespace": draw(NAMESPACE),
            "name": draw(st.sampled_from(["s1", "s2"])),
            "labels": {"kubernetes.io/service-name": draw(NAMES)},
        },
        "addressType": draw(st.sampled_from(["IPv4", "IPv6", "FQDN"])),
        "ports": draw(
            st.lists(
                st.fixed_dictionaries(
                    {"port": PORT_NUMBERS, "protocol": PROTOCOLS},
                    optional={"name": st.sampled_from(["http", "dns", ""])},
                ),
                max_size=3,
            )
        ),
        "endpoints": endpoints,
    }


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("upsert"), st.just(SERVICES), services()),
        st.tuples(st.just("upsert"), st.just(SLICES), slices()),
        st.tuples(st.just("delete"), st.just(SERVICES), services()),
        st.tuples(st.just("delete"), st.just(SLICES), slices()),
    ),
    min_size=1,
    max_size=12,
)


def agent() -> tuple[ClusterState, FakeNftables, Proxier]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    fake = FakeNftables()
    backend = NftablesBackend(SETTINGS, fake)
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    proxier.delete_flows = lambda filters: 0
    proxier.max_service_cost = 6  # small enough that generated Services reach it
    return state, fake, proxier


def kernel(fake: Any) -> list[str]:
    """A kernel fake's dump (nftables or iptables) without nftables' empty per-endpoint-count
    maps (created on demand; a partial sync leaves them until a full one)."""
    return [
        line
        for line in fake.dump().splitlines()
        if not (re.match(r"\s*set endpoints-[0-9]+ ", line) and line.endswith("{  }"))
    ]


@PROPERTY
@given(EVENTS)
def test_hostile_objects_always_load_and_partial_syncs_end_where_a_full_sync_does(
    events: list[tuple[str, str, dict[str, Any]]],
) -> None:
    state, fake, proxier = agent()
    for op, kind, obj in events:
        (state.upsert if op == "upsert" else state.delete)(kind, obj)
        outcome = proxier.sync()
        assert outcome.ok, outcome.error
        assert not proxier.problems.of(DATAPLANE), proxier.problems.of(DATAPLANE)
    fresh_state, fresh_fake, fresh = agent()
    for kind, objs in ((SERVICES, state.services), (SLICES, state.slices)):
        fresh_state.replace(kind, list(objs.values()))
    assert fresh.sync().ok
    assert kernel(fake) == kernel(fresh_fake)
    assert proxier.problems.current() == fresh.problems.current()
