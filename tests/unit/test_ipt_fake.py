"""The iptables kernel fake refuses what iptables-restore refuses, atomically; and any sequence
of partial syncs leaves it as one full sync of the final state would (fixed seeds)."""

from __future__ import annotations

import random

import pytest
from backend_samples import SETTINGS, sample_state
from test_nft_fake import mutate

from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeError, FakeIptables
from kpx_agent.model.types import ServicePort


def backend_on(fake: FakeIptables) -> IptablesBackend:
    return IptablesBackend(
        SETTINGS,
        fake,
        ensure_sysctl=lambda path, value: None,
    )


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("*nat\n:KPX-A - [0:0]\n-A KPX-A -j KPX-NOWHERE\nCOMMIT\n", "no such chain"),
        ("*nat\n-A KPX-NOWHERE -j ACCEPT\nCOMMIT\n", "no chain"),
        ("*nat\n-D PREROUTING -j KPX-SERVICES\nCOMMIT\n", "no such rule"),
        (f"*nat\n-X {n.MARK_MASQ}\nCOMMIT\n", "still used"),
        ("*nat\n:KPX-A - [0:0]\n", "no COMMIT"),
    ],
)
def test_restore_refuses_as_the_tool_does_and_applies_nothing(script: str, reason: str) -> None:
    fake = FakeIptables()
    backend_on(fake).sync(sample_state(), None)
    before = fake.dump()
    with pytest.raises(FakeError, match=reason):
        fake.restore(4, script)
    assert fake.dump() == before


def test_a_second_full_sync_reads_the_fake_back_and_changes_nothing() -> None:
    fake = FakeIptables()
    backend = backend_on(fake)
    backend.sync(sample_state(), None)
    first = fake.dump()
    assert fake.tables[(4, "nat")]["PREROUTING"] == ["-m comment --comment kpx -j KPX-SERVICES"]
    backend.sync(sample_state(), None)  # parses save(): keeps its jumps, rewrites its chains
    assert fake.dump() == first


@pytest.mark.parametrize("seed", range(8))
def test_partial_syncs_end_where_one_full_sync_of_the_final_state_does(seed: int) -> None:
    rng = random.Random(seed)
    fake = FakeIptables()
    backend = backend_on(fake)
    state = sample_state()
    backend.sync(state, None)
    v4 = [k for k in state.services if k.family == 4]
    removed: dict[object, ServicePort] = {}
    for _ in range(25):
        changed = rng.sample(v4, rng.randrange(1, 4))
        for key in changed:
            if key in state.services and rng.random() < 0.15:
                removed[key] = state.services.pop(key)
            elif key in state.services:
                state.services[key] = mutate(rng, state.services[key])
            else:
                state.services[key] = mutate(rng, removed.pop(key))
        backend.sync(state, changed)
    full = FakeIptables()
    backend_on(full).sync(state, None)
    assert fake.dump() == full.dump()
