"""The shared semantics matrix (semantics.py) against the kernel fakes, without root: each
case's Service ports are synced by the real backend code into its mode's fake kernel (shipped
beside each backend: nftables.fake, iptables.fake, ipvs.fake), and the case's packet is traced
through what the backend programmed. The ipvs column expects the outcomes of the other modes
but where semantics.IPVS_OUTCOMES documents upstream's ipvs behaviour instead (the same table
the ipvs column in a kernel with IPVS uses: tests/e2e/test_ipvs_semantics_matrix.py)."""

from __future__ import annotations

import pytest
from semantics import (
    CASES,
    IPVS_OUTCOMES,
    WORLD,
    Case,
    Outcome,
    Packet,
    ipvs_allowed,
    node_of,
    packet,
    settings_of,
)

from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.backends.ipvs.backend import IpvsBackend
from kpx_agent.backends.ipvs.fake import FakeKernel
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.model.service_ports import local_state


def nft_outcomes(case: Case, pkt: Packet) -> set[Outcome]:
    fake = FakeNftables()
    settings = settings_of(case)
    backend = NftablesBackend(settings, fake)
    backend.sync(local_state(node_of(), settings, case.ports(WORLD)), None)
    return fake.trace(pkt)


def ipt_outcomes(case: Case, pkt: Packet) -> set[Outcome]:
    fake = FakeIptables()
    settings = settings_of(case)
    backend = IptablesBackend(
        settings,
        fake,
        ensure_sysctl=lambda path, value: None,
    )
    backend.sync(local_state(node_of(), settings, case.ports(WORLD)), None)
    return fake.trace(pkt)


def ipvs_outcomes(case: Case, pkt: Packet) -> set[Outcome]:
    fake = FakeKernel()
    settings = settings_of(case)
    backend = IpvsBackend(settings, fake)
    backend.sync(local_state(node_of(), settings, case.ports(WORLD)), None)
    return fake.trace(pkt)


BACKENDS = {"nftables": nft_outcomes, "iptables": ipt_outcomes, "ipvs": ipvs_outcomes}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_semantics(case: Case, backend: str) -> None:
    allowed = ipvs_allowed(case) if backend == "ipvs" else case.allowed
    got = BACKENDS[backend](case, packet(case))
    assert got == allowed(WORLD), (case.name, got)


def test_every_ipvs_difference_names_a_case_and_differs() -> None:
    """A documented difference names a case of the matrix and changes its outcome (else it
    would excuse nothing, or hide a case)."""
    for name, (item, allowed) in IPVS_OUTCOMES.items():
        case = next(c for c in CASES if c.name == name)
        assert item and allowed(WORLD) != case.allowed(WORLD), name
