"""Admission: the ipvs policy and conflicts between node selectors, one row per case."""

from __future__ import annotations

import pytest

from kpx_api import MODES_WITH_BACKEND, Mode
from kpx_operator.admission import (
    IPVSPolicy,
    PxcInfo,
    admit,
    conflict_message,
    node_list,
    orphaned_agents,
)

NODES = {
    "a1": {"pool": "a"},
    "a2": {"pool": "a", "gpu": "yes"},
    "b1": {"pool": "b"},
}


def pxc(name: str, created: str, mode: str = "nftables", **selector: str) -> PxcInfo:
    return PxcInfo(name, f"uid-{name}", created, mode, tuple(sorted(selector.items())))


OLD_ALL = pxc("everything", "2026-01-01T00:00:00Z")
POOL_A = pxc("pool-a", "2026-01-02T00:00:00Z", pool="a")
POOL_B = pxc("pool-b", "2026-01-02T00:00:00Z", pool="b")
GPU = pxc("gpu", "2026-01-03T00:00:00Z", gpu="yes")
IPVS_A = pxc("ipvs-a", "2025-12-01T00:00:00Z", "ipvs", pool="a")
#: Every mode with a backend: the policy rules as they apply once ipvs has its backend.
ALL_BACKENDS = frozenset(Mode)
#: A gate without ipvs (as before ipvs had its backend): what a mode without a backend does.
NO_IPVS = frozenset({Mode.NFTABLES, Mode.IPTABLES})


@pytest.mark.parametrize(
    ("me", "others", "policy", "kept_out", "overlaps"),
    [
        # Disjoint pools: no conflict.
        (POOL_A, [POOL_A, POOL_B], IPVSPolicy.WARN, (), []),
        # The newer one keeps the contested nodes out; both see the conflict with the names.
        (
            POOL_A,
            [OLD_ALL, POOL_A],
            IPVSPolicy.WARN,
            ("a1", "a2"),
            [("everything", ("a1", "a2"), True)],
        ),
        (OLD_ALL, [OLD_ALL, POOL_A], IPVSPolicy.WARN, (), [("pool-a", ("a1", "a2"), False)]),
        # Pairwise: gpu overlaps pool-a (older) on a2 only, and keeps a2 out even though
        # pool-a itself keeps it out (everything is older still).
        (
            GPU,
            [OLD_ALL, POOL_A, GPU],
            IPVSPolicy.WARN,
            ("a2",),
            [("everything", ("a2",), True), ("pool-a", ("a2",), True)],
        ),
        # Only the contested node: the newer one's other nodes stay in.
        (
            pxc("a-and-b", "2026-02-01T00:00:00Z"),
            [POOL_A, pxc("a-and-b", "2026-02-01T00:00:00Z")],
            IPVSPolicy.WARN,
            ("a1", "a2"),
            [("pool-a", ("a1", "a2"), True)],
        ),
        # Same creation time: the name decides (pool-a < pool-b); here they are disjoint anyway.
        (POOL_B, [POOL_A, POOL_B], IPVSPolicy.WARN, (), []),
        # A denied ipvs configuration deploys nothing, so it conflicts with nobody.
        (POOL_A, [IPVS_A, POOL_A], IPVSPolicy.DENY, (), []),
        # An allowed ipvs configuration (ipvs has its backend) is a real conflict.
        (
            POOL_A,
            [IPVS_A, POOL_A],
            IPVSPolicy.ALLOW,
            ("a1", "a2"),
            [("ipvs-a", ("a1", "a2"), True)],
        ),
        # A selector that selects no existing node conflicts with nobody.
        (pxc("none", "2026-02-01T00:00:00Z", pool="z"), [OLD_ALL], IPVSPolicy.WARN, (), []),
    ],
)
def test_admission(
    me: PxcInfo,
    others: list[PxcInfo],
    policy: IPVSPolicy,
    kept_out: tuple[str, ...],
    overlaps: list[tuple[str, tuple[str, ...], bool]],
) -> None:
    adm = admit(me, others, NODES, policy)
    # A conflict never stops a configuration from deploying (issue #22): it keeps nodes out.
    assert adm.deploy is True
    assert adm.kept_out == kept_out
    assert [(o.other, o.nodes, o.other_is_older) for o in adm.overlaps] == overlaps


@pytest.mark.parametrize(
    ("policy", "deploy", "denied"),
    [
        (IPVSPolicy.ALLOW, True, False),
        (IPVSPolicy.WARN, True, False),
        (IPVSPolicy.DENY, False, True),
    ],
)
def test_ipvs_policy(policy: IPVSPolicy, deploy: bool, denied: bool) -> None:
    adm = admit(IPVS_A, [IPVS_A], NODES, policy, ALL_BACKENDS)
    assert (adm.deploy, adm.ipvs_denied, adm.deprecated) == (deploy, denied, True)


def test_with_an_ipvs_backend_an_allowed_ipvs_configuration_conflicts() -> None:
    adm = admit(POOL_A, [IPVS_A, POOL_A], NODES, IPVSPolicy.ALLOW, ALL_BACKENDS)
    assert adm.deploy and adm.kept_out == ("a1", "a2")
    assert [(o.other, o.nodes, o.other_is_older) for o in adm.overlaps] == [
        ("ipvs-a", ("a1", "a2"), True)
    ]


@pytest.mark.parametrize(
    ("policy", "no_backend", "denied"),
    [
        (IPVSPolicy.ALLOW, True, False),
        (IPVSPolicy.WARN, True, False),
        # deny is the operator's own decision: it says so rather than "no backend".
        (IPVSPolicy.DENY, False, True),
    ],
)
def test_mode_without_a_backend_deploys_nothing(
    policy: IPVSPolicy, no_backend: bool, denied: bool
) -> None:
    assert "ipvs" in MODES_WITH_BACKEND  # the gate today; NO_IPVS is a gate without it
    adm = admit(IPVS_A, [IPVS_A, POOL_A], NODES, policy, NO_IPVS)
    assert (adm.deploy, adm.no_backend, adm.ipvs_denied) == (False, no_backend, denied)
    assert adm.overlaps == ()
    # Modes with a backend are untouched by the gate.
    assert admit(POOL_B, [POOL_B], NODES, policy, NO_IPVS).deploy


def test_info_from_a_body() -> None:
    body = {
        "metadata": {"name": "x", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"mode": "iptables", "nodeSelector": {"b": "2", "a": "1"}},
    }
    info = PxcInfo.from_body(body)
    assert info == PxcInfo("x", "u", "2026-01-01T00:00:00Z", "iptables", (("a", "1"), ("b", "2")))
    assert info.selects({"a": "1", "b": "2", "c": "3"})
    assert not info.selects({"a": "1"})
    assert PxcInfo.from_body({"metadata": {"name": "y"}, "spec": {}}).selects({})


def test_messages_name_the_nodes_and_who_runs() -> None:
    adm = admit(POOL_A, [OLD_ALL, POOL_A], NODES, IPVSPolicy.WARN)
    message = conflict_message(adm)
    assert "nodes a1, a2 are also selected by ProxyConfiguration everything" in message
    assert "(older, runs there)" in message
    assert message.endswith(
        "this one keeps its agents off nodes a1, a2 until the node "
        "selectors are disjoint (its other nodes keep theirs)"
    )
    assert "newer, stays off them" in conflict_message(
        admit(OLD_ALL, [POOL_A], NODES, IPVSPolicy.WARN)
    )
    assert node_list([f"n{i}" for i in range(12)]).endswith("n9 and 2 more")


def agent(instance: str, node: str, terminating: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {
        "labels": {"app.kubernetes.io/name": "kpx-agent", "app.kubernetes.io/instance": instance}
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}}


def test_orphaned_agents_hold_their_nodes_against_every_configuration() -> None:
    pods = [
        agent("gone", "a1"),
        agent("gone", "b1"),
        agent("pool-a", "a2"),
        agent("leaving", "a2", terminating=True),
        agent("pending", ""),
    ]
    orphaned = orphaned_agents(pods, {"pool-a", "everything"})
    assert orphaned == {"gone": ("a1", "b1")}
    # Even the oldest configuration keeps those nodes out; only its own are shared.
    adm = admit(OLD_ALL, [OLD_ALL], NODES, IPVSPolicy.WARN, orphaned=orphaned)
    assert adm.kept_out == ("a1", "b1")
    assert [(o.other, o.orphaned) for o in adm.overlaps] == [("gone", True)]
    assert "deleted with deletionPolicy Orphan" in conflict_message(adm)
