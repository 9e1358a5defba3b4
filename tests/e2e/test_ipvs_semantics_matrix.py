"""The ipvs column of the shared semantics matrix (tests/unit/semantics.py), in a kernel with IPVS.

The same cases, topology, packets and judgement as tests/e2e/test_semantics_matrix_kernel.py
(nftables and iptables), with the ipvs backend synced in n1's netns by one long-lived driver
(tests/e2e/ipvs_driver.py: the guest is emulated, a Python start per case would cost seconds).
Where ipvs mode differs as upstream documents it, semantics.IPVS_OUTCOMES gives the outcome
expected instead (the same table the unit tier's ipvs column, through the kernel fake, uses),
each naming its item of "What ipvs mode does not do" in
agents/kpx_agent/backends/ipvs/README.md; every other case must pass as in the other modes.

This host's kernel has no IPVS: the test skips here and runs inside a `proxy-vm` guest, started
by tests/e2e/test_ipvs_in_vm.py, which fails if it fails or skips there. To run some cases
only (when debugging): KPX_MATRIX_CASES=name,name.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from test_ipvs_kernel import Driver, pytestmark  # noqa: F401  (skipped where no IPVS)
from test_semantics_matrix_kernel import Net, net, probe_case  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from semantics import CASES, IPVS_OUTCOMES, ipvs_allowed


def test_semantics_matrix_in_ipvs_mode(net: Net) -> None:  # noqa: F811
    assert IPVS_OUTCOMES.keys() <= {c.name for c in CASES}, "a difference names no case"
    driver = Driver(net.topo, net.n1, "ipvs")
    world = dataclasses.asdict(net.world)
    failures = []
    only = set(filter(None, os.environ.get("KPX_MATRIX_CASES", "").split(",")))
    for case in CASES:
        if only and case.name not in only:
            continue
        driver.step(case=case.name, world=world)
        allowed = ipvs_allowed(case)(net.world)
        problem = probe_case(net, case, allowed)
        if problem:
            failures.append(problem)
    driver.step(cleanup=True)
    assert not failures, "\n".join(failures)
