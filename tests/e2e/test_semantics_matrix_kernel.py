"""The shared semantics matrix (tests/unit/semantics.py) against the real kernel: the same
cases as the fake tier, for both backends, with real packets between network namespaces.

The topology: n1 (the proxy) with pods b1 (an endpoint), client (bridged) and rclient (a
routed veth); n2 with b2 (an endpoint) and far; n3, a host outside the cluster. n2 and n3 route
the Service CIDR and the load-balancer range via n1. For each case the backend (in n1's netns)
syncs the case's Service ports, then the case's sender connects; what the endpoints saw is
compared with the case's allowed outcomes: which endpoint answered and with which source
(masquerade), a reset (reject), silence (drop), or no DNAT at all. To run some cases only (when
debugging): KPX_MATRIX_CASES=name,name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from three_node_net import ThreeNodes

from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.probe import ProbeResult, probe

UNIT = Path(__file__).resolve().parents[1] / "unit"
sys.path.insert(0, str(UNIT))

from semantics import CASES, EXT_IP, LB_IP, VIP, VIP6, Case, Outcome, World  # noqa: E402

pytestmark = pytest.mark.netns
MODES = ("nftables", "iptables")

# Runs inside n1's netns: argv[1] is a JSON spec (step, mode, world, case).
PROGRAM = f"""
import json, sys
sys.path.insert(0, {str(UNIT)!r})
from semantics import CASES, World, node_of, settings_of
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables.backend import IptablesBackend, cleanup as ipt_cleanup
from kpx_agent.backends.nftables.backend import NftablesBackend, cleanup as nft_cleanup

spec = json.loads(sys.argv[1])
if spec["step"] == "cleanup":
    (ipt_cleanup if spec["mode"] == "iptables" else nft_cleanup)()
    sys.exit(0)
w = World(**spec["world"])
case = next(c for c in CASES if c.name == spec["case"])
settings = settings_of(case, w)
backend = (IptablesBackend if spec["mode"] == "iptables" else NftablesBackend)(settings)
backend.sync(local_state(node_of(w), settings, case.ports(w)), None)
print("synced")
"""


class Net(ThreeNodes):
    @property
    def world(self) -> World:
        p = self.pods
        return World(
            node=self.n1.ipv4,
            node_v6=self.n1.ipv6,
            b1=p["b1"].ipv4,
            b2=p["b2"].ipv4,
            b1_v6=p["b1"].ipv6,
            b2_v6=p["b2"].ipv6,
            client=p["client"].ipv4,
            client_v6=p["client"].ipv6,
            rclient=p["rclient"].ipv4,
            far=p["far"].ipv4,
            ext=self.n3.ipv4,
            pod_cidr=self.n1.pod_cidr_v4,
            pod_cidr_v6=self.n1.pod_cidr_v6,
            routed_prefix=p["rclient"].host_if.rstrip("0123456789"),
        )

    def run(self, spec: dict[str, object]) -> None:
        run = self.topo.exec(self.n1, [sys.executable, "-c", PROGRAM, json.dumps(spec)])
        assert run.returncode == 0, run.stderr

    def sender(self, name: str) -> Node | Pod:
        return {"node": self.n1, "ext": self.n3}.get(name) or self.pods[name]


@pytest.fixture
def net(topology: Topology) -> Iterator[Net]:
    yield Net.build(topology)


def destination(net: Net, case: Case) -> str:
    return {"vip": VIP, "vip6": VIP6, "ext_ip": EXT_IP, "lb": LB_IP, "node": net.n1.ipv4}[case.dest]


def endpoint_names(w: World) -> dict[str, str]:
    """The endpoints' addresses -> their names in World (b1, b2, b1_v6, b2_v6)."""
    return {getattr(w, t): t for t in ("b1", "b2", "b1_v6", "b2_v6")}


def asymmetric(net: Net, case: Case, allowed: set[Outcome]) -> bool:
    """Whether a try may be DNATed to b2 (on n2) unmasqueraded from a sender off n1: b2's
    replies then bypass n1, never reach the sender as the VIP's, and that try times out."""
    names = endpoint_names(net.world)
    return case.sender in ("far", "ext") and any(
        o.dnat and not o.masquerade and names[o.dnat[0]].startswith("b2") for o in allowed
    )


# An asymmetric case's tries that all time out may only have all gone to b2 (each does with
# probability 1/2; all 6 with 1/64). It is probed again, up to this many rounds in all, until
# one try answers: rules that never DNAT to b1 still fail, after 24 tries; correct rules fail
# by chance with probability 2^-24.
ASYMMETRIC_ROUNDS = 4


def observed_ok(net: Net, case: Case, allowed: set[Outcome], result: ProbeResult) -> str:
    """'' when what the endpoints saw fits one of the allowed outcomes; else why not."""
    verdicts = {o.verdict for o in allowed}
    w = net.world
    if verdicts == {"reject"}:
        return "" if result.refused == result.failed and not result.answered else "not rejected"
    if verdicts == {"drop"}:
        return "" if result.timeout and not result.answered else "not dropped"
    if all(o.dnat is None for o in allowed):
        return "" if not result.answered else "DNATed"
    names = endpoint_names(w)
    # A sender off n1 whose connection is DNATed to b2 (on n2) without masquerade: b2's
    # replies do not pass n1 (asymmetric), so those tries time out; the rest must answer.
    if result.failed and not (
        asymmetric(net, case, allowed) and result.answered and result.failed == result.timeout
    ):
        return "some tries failed"
    sender = net.sender(case.sender)
    own = sender.ipv6 if case.family == 6 else sender.ipv4
    for backend, sources in result.sources.items():
        # The echo server's name is b1 or b2; map the allowed DNAT targets to them.
        wanted = {
            o.masquerade
            for o in allowed
            if o.dnat and names[o.dnat[0]].removesuffix("_v6") == backend
        }
        if not wanted:
            return f"{backend} answered"
        for source in sources:
            masqueraded = source != own
            if case.sender == "node":
                masqueraded = True  # the node's own address either way
            if masqueraded not in wanted:
                return f"{backend} saw {source} (masquerade allowed: {wanted})"
    return ""


def probe_case(net: Net, case: Case, allowed: set[Outcome]) -> str | None:
    """Send the case's probe and judge it: None when what the endpoints saw is allowed, else
    what went wrong (shared with the ipvs column, tests/e2e/test_ipvs_semantics_matrix.py)."""
    quiet = {o.verdict for o in allowed} <= {"drop"} or all(o.dnat is None for o in allowed)
    rounds = ASYMMETRIC_ROUNDS if asymmetric(net, case, allowed) else 1
    for _ in range(rounds):
        result = probe(
            net.topo,
            net.sender(case.sender),
            destination(net, case),
            case.port,
            "tcp",
            count=2 if quiet else 6,
            timeout=0.5 if quiet else 1,
        )
        if result.answered or result.failed != result.timeout:
            break
    problem = observed_ok(net, case, allowed, result)
    return f"{case.name}: {problem}: {result}" if problem else None


@pytest.mark.parametrize("mode", MODES)
def test_semantics_matrix_in_the_kernel(net: Net, mode: str) -> None:
    world = dataclasses.asdict(net.world)
    failures = []
    only = set(filter(None, os.environ.get("KPX_MATRIX_CASES", "").split(",")))
    for case in CASES:
        if only and case.name not in only:
            continue
        net.run({"step": "sync", "mode": mode, "world": world, "case": case.name})
        problem = probe_case(net, case, case.allowed(net.world))
        if problem:
            failures.append(problem)
    net.run({"step": "cleanup", "mode": mode})
    assert not failures, "\n".join(failures)
