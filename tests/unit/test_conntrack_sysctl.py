"""spec.conntrack on the node: the pure planner (as upstream kube-proxy's setSysctls) and the
file edge against a directory standing in for /proc/sys/net/netfilter (never the host's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kpx_agent.conntrack import sysctl as cs
from kpx_agent.conntrack.sysctl import ConntrackPaths, Write
from kpx_api import Conntrack

LEAVE_ALONE = Conntrack(max_per_core=0, tcp_established_timeout="0s", tcp_close_wait_timeout="0s")


def ct(**kw: Any) -> Conntrack:
    return Conntrack.model_validate(kw)


@pytest.mark.parametrize(
    ("max_per_core", "minimum", "cpus", "expected"),
    [
        (0, 131072, 8, 0),  # maxPerCore 0: leave nf_conntrack_max alone
        (12, 0, 8, 96),  # upstream's test: 12 per core x 8
        (32768, 131072, 2, 131072),  # the floor wins (the defaults on 2 cores)
        (32768, 131072, 8, 262144),
        (32768, 0, 512, 1_048_576),  # upstream caps the product at 1M
        (32768, 2_000_000, 512, 1_048_576),  # ...before the floor, as upstream
    ],
)
def test_conntrack_max(max_per_core: int, minimum: int, cpus: int, expected: int) -> None:
    assert cs.conntrack_max(max_per_core, minimum, cpus) == expected


def test_defaults_are_upstreams() -> None:
    assert cs.wanted(Conntrack(), cpus=2) == {
        cs.MAX: 131072,
        cs.HASHSIZE: 32768,
        cs.TCP_ESTABLISHED: 86400,
        cs.TCP_CLOSE_WAIT: 3600,
    }
    assert cs.manages_node(Conntrack()) and cs.manages_hashsize(Conntrack())


@pytest.mark.parametrize(
    "conntrack",
    [
        Conntrack(),
        LEAVE_ALONE,
        ct(maxPerCore=0, tcpEstablishedTimeout="0s"),
        ct(maxPerCore=0, tcpEstablishedTimeout="0s", tcpCloseWaitTimeout="0s", udpTimeout="1s"),
        ct(maxPerCore=1, tcpEstablishedTimeout="0s", tcpCloseWaitTimeout="0s"),
        ct(maxPerCore=0, tcpEstablishedTimeout="0s", tcpCloseWaitTimeout="0s", tcpBeLiberal=True),
    ],
)
def test_the_operators_rule_agrees_with_the_planner(conntrack: Conntrack) -> None:
    """The operator gives the pod access to the node's values by Conntrack.leaves_node_alone;
    the agent writes what `wanted` says: they must agree."""
    for cpus in (1, 2, 64):
        assert conntrack.leaves_node_alone() is (cs.wanted(conntrack, cpus) == {})


def test_leave_alone_values_ask_for_nothing() -> None:
    assert cs.wanted(LEAVE_ALONE, cpus=64) == {}
    assert not cs.manages_node(LEAVE_ALONE) and not cs.manages_hashsize(LEAVE_ALONE)
    # min alone changes nothing: it only bounds maxPerCore x cpus.
    assert not cs.manages_node(LEAVE_ALONE.model_copy(update={"min": 1}))


@pytest.mark.parametrize(
    ("field", "value", "setting", "expected"),
    [
        ("tcpEstablishedTimeout", "5s", cs.TCP_ESTABLISHED, 5),
        ("tcpCloseWaitTimeout", "1m30s", cs.TCP_CLOSE_WAIT, 90),
        ("udpTimeout", "30s", cs.UDP, 30),
        ("udpStreamTimeout", "2m", cs.UDP_STREAM, 120),
        ("tcpBeLiberal", True, cs.TCP_BE_LIBERAL, 1),
    ],
)
def test_each_setting_alone(field: str, value: Any, setting: str, expected: int) -> None:
    base = {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    conntrack = ct(**{**base, field: value})
    assert cs.wanted(conntrack, cpus=4) == {setting: expected}
    assert cs.manages_node(conntrack) and not cs.manages_hashsize(conntrack)


WANT = {cs.MAX: 96, cs.HASHSIZE: 24, cs.TCP_ESTABLISHED: 5}


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        # Upstream's cases (TestSetupConntrack), with the timeout as it is.
        (
            {cs.MAX: None, cs.HASHSIZE: None, cs.TCP_ESTABLISHED: 5},
            [Write(cs.MAX, 96, None), Write(cs.HASHSIZE, 24, None)],
        ),
        ({cs.MAX: 96, cs.HASHSIZE: 24, cs.TCP_ESTABLISHED: 5}, []),
        ({cs.MAX: 192, cs.HASHSIZE: 48, cs.TCP_ESTABLISHED: 5}, []),  # never lowered
        (
            {cs.MAX: 48, cs.HASHSIZE: 12, cs.TCP_ESTABLISHED: 5},
            [Write(cs.MAX, 96, 48), Write(cs.HASHSIZE, 24, 12)],
        ),
        ({cs.MAX: 96, cs.HASHSIZE: 0, cs.TCP_ESTABLISHED: 5}, [Write(cs.HASHSIZE, 24, 0)]),
        ({cs.MAX: 48, cs.HASHSIZE: 24, cs.TCP_ESTABLISHED: 5}, [Write(cs.MAX, 96, 48)]),
        # Timeouts are set when they differ, up or down.
        (
            {cs.MAX: 96, cs.HASHSIZE: 24, cs.TCP_ESTABLISHED: 432000},
            [Write(cs.TCP_ESTABLISHED, 5, 432000)],
        ),
        ({cs.MAX: 96, cs.HASHSIZE: 24, cs.TCP_ESTABLISHED: 1}, [Write(cs.TCP_ESTABLISHED, 5, 1)]),
    ],
)
def test_plan(current: dict[str, int | None], expected: list[Write]) -> None:
    assert cs.plan(WANT, current) == expected


@pytest.mark.parametrize(("text", "cpus"), [("0", 1), ("0-1\n", 2), ("0-3,8,10-11", 7)])
def test_cpu_list(text: str, cpus: int, tmp_path: Path) -> None:
    assert cs.parse_cpu_list(text) == cpus
    (tmp_path / "online").write_text(text)
    assert cs.node_cpus(tmp_path / "online") == cpus
    assert cs.node_cpus(tmp_path / "missing") >= 1


def fake_node(tmp_path: Path, **values: int) -> ConntrackPaths:
    """A directory of sysctl files with `values`, and a hashsize file."""
    sysctls = tmp_path / "netfilter"
    sysctls.mkdir()
    for name, value in values.items():
        (sysctls if name != cs.HASHSIZE else tmp_path).joinpath(name).write_text(f"{value}\n")
    return ConntrackPaths(sysctls, tmp_path / cs.HASHSIZE)


def test_apply_writes_what_differs_and_nothing_else(tmp_path: Path) -> None:
    paths = fake_node(
        tmp_path,
        nf_conntrack_max=262144,
        hashsize=1024,
        nf_conntrack_tcp_timeout_established=432000,
        nf_conntrack_tcp_timeout_close_wait=3600,
        nf_conntrack_tcp_be_liberal=0,
        nf_conntrack_udp_timeout=30,
    )
    before = {p.name: p.stat().st_mtime_ns for p in paths.sysctl_dir.iterdir()}
    conntrack = ct(maxPerCore=32768, min=131072, tcpBeLiberal=True, udpTimeout="30s")
    outcome = cs.apply(conntrack, paths, cpus=2, host_netns=True)
    assert outcome.ok
    assert [(w.setting, w.value, w.current) for w in outcome.changed] == [
        (cs.HASHSIZE, 32768, 1024),
        (cs.TCP_ESTABLISHED, 86400, 432000),
        (cs.TCP_BE_LIBERAL, 1, 0),
    ]
    read = {p.name: int(p.read_text()) for p in paths.sysctl_dir.iterdir()}
    assert read == {
        "nf_conntrack_max": 262144,
        "nf_conntrack_tcp_timeout_established": 86400,
        "nf_conntrack_tcp_timeout_close_wait": 3600,
        "nf_conntrack_tcp_be_liberal": 1,
        "nf_conntrack_udp_timeout": 30,
    }
    assert int(paths.hashsize_file.read_text()) == 32768
    # Untouched files were not rewritten (max is higher than wanted, close_wait and udp equal).
    for name in (
        "nf_conntrack_max",
        "nf_conntrack_tcp_timeout_close_wait",
        "nf_conntrack_udp_timeout",
    ):
        assert paths.sysctl_dir.joinpath(name).stat().st_mtime_ns == before[name], name
    assert cs.apply(conntrack, paths, cpus=2, host_netns=True).changed == ()  # idempotent


def test_outside_the_host_netns_global_values_are_reported_not_written(tmp_path: Path) -> None:
    paths = fake_node(
        tmp_path, nf_conntrack_max=1000, hashsize=100, nf_conntrack_tcp_timeout_established=1
    )
    conntrack = ct(maxPerCore=0, min=0, tcpCloseWaitTimeout="0s")
    conntrack = conntrack.model_copy(update={"max_per_core": 4096})  # 8192 on 2 CPUs
    outcome = cs.apply(conntrack, paths, cpus=2, host_netns=False)
    assert [w.setting for w in outcome.changed] == [cs.TCP_ESTABLISHED]  # per namespace: set
    assert [f.partition(":")[0] for f in outcome.failures] == [cs.MAX, cs.HASHSIZE]
    assert "not in the host's network namespace" in outcome.failures[0]
    assert paths.of(cs.MAX).read_text() == "1000\n" and paths.of(cs.HASHSIZE).read_text() == "100\n"


def test_apply_with_leave_alone_values_reads_nothing(tmp_path: Path) -> None:
    paths = ConntrackPaths(tmp_path / "absent", tmp_path / "absent-hashsize")
    assert cs.apply(LEAVE_ALONE, paths, cpus=2) == cs.Outcome()


def test_failures_are_reported_per_setting_and_the_rest_applied(tmp_path: Path) -> None:
    paths = fake_node(tmp_path, nf_conntrack_tcp_timeout_established=432000)
    paths.sysctl_dir.joinpath(cs.TCP_CLOSE_WAIT).mkdir()  # unwritable: a directory
    conntrack = ct(maxPerCore=0)
    outcome = cs.apply(conntrack, paths, cpus=2)
    assert [w.setting for w in outcome.changed] == [cs.TCP_ESTABLISHED]
    (failure,) = outcome.failures
    assert failure.startswith(f"{cs.TCP_CLOSE_WAIT}: cannot set 3600 (now unreadable)")
    assert not outcome.ok


def test_a_read_only_nf_conntrack_max_means_not_the_host_namespace(tmp_path: Path) -> None:
    """The kernel shows nf_conntrack_max 0444 outside the host's network namespace."""
    paths = fake_node(tmp_path, nf_conntrack_max=1000, hashsize=100)
    assert cs.globals_writable(paths)
    paths.of(cs.MAX).chmod(0o444)
    assert not cs.globals_writable(paths)
    outcome = cs.apply(
        ct(maxPerCore=4096, tcpEstablishedTimeout="0s", tcpCloseWaitTimeout="0s"), paths, cpus=2
    )
    assert outcome.changed == () and len(outcome.failures) == 2
    assert paths.of(cs.HASHSIZE).read_text() == "100\n"  # root could write it: it did not


def test_missing_sysctls_are_reported_never_created(tmp_path: Path) -> None:
    """No nf_conntrack module (or a wrong mount): nothing is created in its place."""
    paths = fake_node(tmp_path)  # an empty directory, no hashsize file
    outcome = cs.apply(Conntrack(), paths, cpus=2)
    assert outcome.changed == ()
    assert [f.partition(":")[0] for f in outcome.failures] == [
        cs.MAX,
        cs.HASHSIZE,
        cs.TCP_ESTABLISHED,
        cs.TCP_CLOSE_WAIT,
    ]
    assert "No such file or directory" in outcome.failures[0]
    assert list(paths.sysctl_dir.iterdir()) == [] and not paths.hashsize_file.exists()
