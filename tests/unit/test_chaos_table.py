"""The fault table's pure parts (kpx_cluster.chaos.table): accounting and rendering."""

from __future__ import annotations

from kpx_cluster.chaos.table import (
    TABLE_HEAD,
    RowResult,
    Traffic,
    account,
    details,
    exit_status,
    render,
    table_row,
)
from kpx_cluster.migration_load import Held, Summary, Tries

NODES = {"192.168.0.1": "n1", "192.168.0.2": "n2", "fd00::2": "n2"}


def tries(targets: dict[str, list[int]], failures: list[tuple[float, str, str]] = ()) -> Tries:  # type: ignore[assignment]
    t = Tries(tried=sum(v[0] for v in targets.values()), failed=sum(v[1] for v in targets.values()))
    t.targets = targets
    t.failures = list(failures)
    return t


def summary(
    tcp: dict[str, list[int]],
    udp: dict[str, list[int]],
    held_ok: int,
    held_broken: int,
    failures: list[tuple[float, str, str]] = (),
) -> Summary:  # type: ignore[assignment]
    held = [Held("10.96.0.5:81", 10, ["a"]) for _ in range(held_ok)]
    held += [Held("10.96.0.5:81", 3, ["a"], "reset") for _ in range(held_broken)]
    return Summary(10.0, tries(tcp, failures), tries(udp), held)


def test_a_try_is_touched_by_its_client_node_or_its_nodeport_target() -> None:
    loads = [
        (
            "n1",
            summary(
                {"10.96.0.5:80": [10, 0], "192.168.0.2:30080": [5, 2]},
                {"[fd00::2]:30053": [4, 1], "10.96.0.5:53": [6, 0]},
                2,
                0,
            ),
        ),
        ("n2", summary({"10.96.0.5:80": [10, 3]}, {"10.96.0.5:53": [8, 2]}, 1, 1)),
    ]
    t = account(loads, ["n2"], NODES)
    # n1's tries to n2's NodePort count as touched; n2's all count as touched
    assert (t.tcp.touched.tried, t.tcp.touched.failed) == (15, 5)
    assert (t.tcp.others.tried, t.tcp.others.failed) == (10, 0)
    assert (t.udp.touched.tried, t.udp.touched.failed) == (12, 3)
    assert (t.udp.others.tried, t.udp.others.failed) == (6, 0)
    assert (t.held_touched.tried, t.held_touched.failed) == (2, 1)
    assert (t.held_others.tried, t.held_others.failed) == (2, 0)


def test_failures_on_untouched_nodes_are_sampled_but_not_those_to_touched_nodeports() -> None:
    fails = [(1.5, "10.96.0.5:80", "timeout"), (2.0, "192.168.0.2:30080", "timeout")]
    loads = [
        ("n1", summary({"10.96.0.5:80": [4, 1], "192.168.0.2:30080": [4, 1]}, {}, 0, 0, fails))
    ]
    t = account(loads, ["n2"], NODES)
    assert t.others_failures == ["n1 tcp +1.5s 10.96.0.5:80 timeout"]


def test_nothing_touched_puts_everything_in_others() -> None:
    t = account([("n1", summary({"192.168.0.2:30080": [3, 0]}, {}, 1, 0))], [], NODES)
    assert t.tcp.others.tried == 3 and t.tcp.touched.tried == 0


def test_goal_others_only_unless_strict() -> None:
    traffic = account([("n2", summary({"10.96.0.5:80": [10, 4]}, {}, 0, 0))], ["n2"], NODES)
    row = RowResult("flush", "nft flush", "n2", traffic, converged=3.0, changes=1)
    assert row.problems() == [] and row.verdict == "pass"
    row.strict = True
    assert row.problems() == ["4 of 10 new TCP connections failed (touched)"]
    assert row.verdict == "FAIL" and exit_status([row]) == 1


def test_lost_changes_and_no_convergence_fail() -> None:
    row = RowResult("x", "y", "none", Traffic(), converged=None, changes=2, lost=["chaos-1@n1"])
    assert row.problems() == ["1 changes lost: chaos-1@n1", "did not converge"]
    errored = RowResult("x", "y", "none", error="boom")
    assert errored.problems() == ["harness error: boom"]


def test_rendering() -> None:
    traffic = account(
        [("n1", summary({"10.96.0.5:80": [100, 0]}, {"10.96.0.5:53": [50, 1]}, 2, 0))], [], NODES
    )
    row = RowResult("apiserver stopped 60 s", "SIGTERM", "none", traffic, converged=4.25, changes=1)
    assert table_row(row) == (
        "| apiserver stopped 60 s | SIGTERM | none | 0 / 0 · 100 / 0 | 0 / 0 · 50 / 1 "
        "| 0 of 0 · 2 of 2 | 4.2 | 0 of 1 | FAIL |"
    )
    skipped = RowResult("node reboot", "", "", not_built="no reboot")
    assert table_row(skipped) == "| node reboot | not built: no reboot | | | | | | | not built |"
    assert exit_status([skipped]) == 0
    text = render([row, skipped])
    assert text.startswith(TABLE_HEAD) and text.count("\n") == 3
    assert details([row, skipped]) == [
        "- apiserver stopped 60 s:",
        "  - goal missed: 1 of 50 UDP exchanges lost (others)",
    ]


def test_kubectl_create_output_one_object_after_another_or_a_list() -> None:
    from kpx_cluster.chaos.runner import json_objects

    one, two = {"kind": "Service", "n": 1}, {"kind": "Service", "n": 2}
    assert list(json_objects('{"kind": "Service", "n": 1}\n{"kind": "Service", "n": 2}\n')) == [
        one,
        two,
    ]
    assert list(json_objects('{"kind": "List", "items": [{"kind": "Service", "n": 1}]}')) == [one]
    assert list(json_objects("  \n")) == []
