"""Service problems: each reported once while it lasts, one Event name per problem cluster-wide."""

from __future__ import annotations

from datetime import UTC, datetime

from kpx_agent.model.service_problems import (
    QUARANTINED,
    VIP_CLASH,
    ProblemBook,
    ServiceProblem,
    event_body,
    event_name,
)

A = ServiceProblem("team-a", "web", VIP_CLASH, "externalIPs 10.96.0.10 is the ClusterIP of b/dns")
B = ServiceProblem("team-b", "big", QUARANTINED, "4,000 endpoints x 100 ports is over the cap")


def test_a_problem_is_reported_once_while_it_lasts_and_again_when_it_returns() -> None:
    book = ProblemBook()
    book.replace("model", [A])
    assert book.take_new() == [A]
    book.replace("model", [A])
    assert book.take_new() == []
    book.replace("model", [])
    assert book.take_new() == []
    assert book.current() == frozenset()
    book.replace("model", [A])
    assert book.take_new() == [A]


def test_sources_replace_only_their_own_problems() -> None:
    book = ProblemBook()
    book.replace("model", [A])
    book.replace("dataplane", [B])
    assert book.current() == {A, B}
    book.replace("dataplane", [])
    assert book.current() == {A}
    assert book.of("model") == {A}
    assert book.counts() == {VIP_CLASH: 1}


def test_every_node_derives_the_same_event_name_for_the_same_problem() -> None:
    now = datetime(2026, 11, 26, tzinfo=UTC)
    one, other = event_body(A, "node-1", now), event_body(A, "node-2", now)
    assert one["metadata"] == other["metadata"] == {"name": event_name(A), "namespace": "team-a"}
    assert one["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Service",
        "name": "web",
        "namespace": "team-a",
    }
    assert one["type"] == "Warning" and one["reason"] == VIP_CLASH
    assert event_name(A) != event_name(B)
    long = ServiceProblem("n" * 63, "s" * 63, QUARANTINED, "m")
    assert len(event_name(long)) <= 253
