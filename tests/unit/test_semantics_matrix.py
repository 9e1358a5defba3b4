"""The shared semantics matrix (semantics.py) against the kernel fakes, without root: each
case's Service ports are synced by the real backend code into a fake kernel, and the case's
packet is traced through what the backend programmed."""

from __future__ import annotations

import pytest
from semantics import CASES, WORLD, Case, Outcome, Packet, node_of, packet, settings_of

from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.node_local import local_state


def nft_outcomes(case: Case, pkt: Packet) -> set[Outcome]:
    fake = FakeNftables()
    settings = settings_of(case)
    backend = NftablesBackend(
        settings,
        run_transactions=fake.run_transactions,
        present_families=fake.present_families,
        load_elements=fake.load_elements,
    )
    backend.sync(local_state(node_of(), settings, case.ports(WORLD)), None)
    return fake.trace(pkt)


def ipt_outcomes(case: Case, pkt: Packet) -> set[Outcome]:
    fake = FakeIptables()
    settings = settings_of(case)
    backend = IptablesBackend(
        settings,
        restore=fake.restore,
        save=fake.save,
        chain_exists=fake.chain_exists,
        ensure_sysctl=lambda path, value: None,
    )
    backend.sync(local_state(node_of(), settings, case.ports(WORLD)), None)
    return fake.trace(pkt)


BACKENDS = {"nftables": nft_outcomes, "iptables": ipt_outcomes}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_semantics(case: Case, backend: str) -> None:
    got = BACKENDS[backend](case, packet(case))
    assert got == case.allowed(WORLD), (case.name, got)
