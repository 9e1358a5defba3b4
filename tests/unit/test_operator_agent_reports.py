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


def event(uid: str, reason: str, at: str, message: str = "m", rv: str = "1",
          source: str = "kpx-agent") -> dict[str, Any]:  # fmt: skip
    return {"metadata": {"resourceVersion": rv}, "involvedObject": {"uid": uid},
            "reason": reason, "message": message, "lastTimestamp": at,
            "source": {"component": source}}  # fmt: skip


BAD, GOOD = "ConntrackNotApplied", "ConntrackApplied"
PODS = [pod("a", "n1"), pod("b", "n2"), pod("c", "n3", deleting=True)]


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], ()),
        ([event("a", BAD, "t1", "x")], (NodeProblem("n1", "x"),)),
        # A later success clears it; a later failure brings it back.
        ([event("a", BAD, "t1"), event("a", GOOD, "t2")], ()),
        ([event("a", GOOD, "t1"), event("a", BAD, "t2", "y")], (NodeProblem("n1", "y"),)),
        # Same second: the later resourceVersion wins.
        ([event("a", BAD, "t1", rv="5"), event("a", GOOD, "t1", rv="7")], ()),
        # Pods that are gone or going, and events from other components, do not count.
        ([event("c", BAD, "t1"), event("zz", BAD, "t1")], ()),
        ([event("a", BAD, "t1", source="kubelet")], ()),
        ([event("a", "Other", "t1")], ()),
        ([event("b", BAD, "t1", "q"), event("a", BAD, "t1", "p")],
         (NodeProblem("n1", "p"), NodeProblem("n2", "q"))),
    ],
)  # fmt: skip
def test_conntrack_problems(
    events: list[dict[str, Any]], expected: tuple[NodeProblem, ...]
) -> None:
    assert conntrack_problems(PODS, events) == expected


def test_message_names_the_nodes() -> None:
    one = (NodeProblem("n1", "nf_conntrack_max: cannot set"),)
    assert conntrack_message(one) == (
        "spec.conntrack is not applied on node n1: nf_conntrack_max: cannot set"
    )
    two = (*one, NodeProblem("n2", "other"))
    assert conntrack_message(two).startswith("spec.conntrack is not applied on nodes n1, n2: nf_")
