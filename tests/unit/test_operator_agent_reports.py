"""What the agents report about their Pods, as the status sees it: one row per situation."""

from __future__ import annotations

from typing import Any

import pytest

from kpx_operator.agent_reports import NodeProblem, conntrack_message, conntrack_problems


def pod(uid: str, node: str, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}}


def state(uid: str, node: str, not_applied: str = "") -> dict[str, Any]:
    """`node`'s ProxyNodeState as the agent Pod `uid` wrote it."""
    return {
        "metadata": {"name": node},
        "status": {
            "mode": "nftables",
            "agentPod": {"name": f"p-{uid}", "uid": uid},
            "conntrackNotApplied": not_applied,
        },
    }


PODS = [pod("a", "n1"), pod("b", "n2"), pod("c", "n3", deleting=True)]
SAID = "conntrack settings not applied: "


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], ()),
        ([state("a", "n1", "x")], (NodeProblem("n1", SAID + "x"),)),
        ([state("a", "n1", "")], ()),  # applied
        # Pods that are gone or going, a state about another node, one that does not parse:
        # they do not count.
        ([state("c", "n3", "x"), state("zz", "n1", "x")], ()),
        ([state("b", "n1", "x")], ()),
        ([{"metadata": {"name": "n1"}, "status": {"mode": "bogus"}}], ()),
        (
            [state("b", "n2", "q"), state("a", "n1", "p")],
            (NodeProblem("n1", SAID + "p"), NodeProblem("n2", SAID + "q")),
        ),
    ],
)
def test_conntrack_problems(
    states: list[dict[str, Any]], expected: tuple[NodeProblem, ...]
) -> None:
    assert conntrack_problems(PODS, states) == expected


def test_message_names_the_nodes() -> None:
    one = (NodeProblem("n1", "nf_conntrack_max: cannot set"),)
    assert conntrack_message(one) == (
        "spec.conntrack is not applied on node n1: nf_conntrack_max: cannot set"
    )
    two = (*one, NodeProblem("n2", "other"))
    assert conntrack_message(two).startswith("spec.conntrack is not applied on nodes n1, n2: nf_")
