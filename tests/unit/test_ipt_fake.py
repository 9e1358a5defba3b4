"""The iptables kernel fake refuses what iptables-restore refuses, atomically; and any sequence
of partial syncs leaves it as one full sync of the final state would (fixed seeds)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from backend_samples import SETTINGS, endpoints, sample_state
from backend_samples import key as port_key
from test_nft_fake import mutate

from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeError, FakeIptables
from kpx_agent.backends.iptables.script import ORDER_FREE
from kpx_agent.model.types import IP, ServicePort


def backend_on(fake: FakeIptables) -> IptablesBackend:
    return IptablesBackend(
        SETTINGS,
        fake,
        ensure_sysctl=lambda path, value: None,
    )


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("*nat\n:KPX-A - [0:0]\n-A KPX-A -j KPX-NOWHERE\nCOMMIT\n", "no chain KPX-NOWHERE yet"),
        ("*nat\n:KPX-A - [0:0]\n-A KPX-A -j KPX-B\n:KPX-B - [0:0]\nCOMMIT\n", "no chain KPX-B yet"),
        ("*nat\n:KPX-A - [0:0]\n-A KPX-A -j ACCEPT\n-X KPX-A\nCOMMIT\n", "not empty"),
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
    assert canonical(fake) == canonical(full)


def canonical(fake: FakeIptables) -> str:
    """The fake's dump with the rules of order-free chains sorted (partial syncs edit those
    rule by rule, `script.ORDER_FREE`; a full sync writes them in key order)."""
    for chains in fake.tables.values():
        for chain in ORDER_FREE & chains.keys():
            chains[chain] = sorted(chains[chain])
    return fake.dump()


def test_a_local_endpoint_change_edits_the_hairpin_chain_rule_by_rule() -> None:
    """KPX-HAIRPIN holds a rule per local endpoint address (12,534 at 10,000 Services):
    rewritten whole, one local endpoint's change was a 0.9 MB restore. A partial sync deletes
    and appends only the rules that change, and leaves the chain undeclared (not flushed)."""
    fake = FakeIptables()
    scripts: list[str] = []
    restore = fake.restore
    fake.restore = lambda family, text: (scripts.append(text), restore(family, text))[1]  # type: ignore[method-assign]
    backend = backend_on(fake)
    state = sample_state()
    ports = [
        ServicePort(
            port_key(f"h{i}"),
            80,
            cluster_ips=(IP.of(f"10.96.1.{i + 1}"),),
            cluster_endpoints=endpoints(f"10.244.9.{i + 1}", local=f"10.244.9.{i + 1}"),
        )
        for i in range(20)
    ]
    for sp in ports:
        state.services[sp.key] = sp
    backend.sync(state, None)
    hairpin = list(fake.tables[(4, "nat")][n.HAIRPIN])
    assert len(hairpin) >= 20
    moved = dataclasses.replace(
        ports[0], cluster_endpoints=endpoints("10.244.9.200", local="10.244.9.200")
    )
    state.services[moved.key] = moved
    done = len(scripts)
    backend.sync(state, [moved.key])
    [nat] = [t for t in scripts[done:] if t.startswith("*nat")]
    lines = nat.splitlines()
    assert f":{n.HAIRPIN} - [0:0]" not in lines
    assert [ln for ln in lines if n.HAIRPIN in ln.split()[:2]] == [
        f"-D {n.HAIRPIN} -s 10.244.9.1/32 -d 10.244.9.1/32 -j {n.MARK_MASQ}",
        f"-A {n.HAIRPIN} -s 10.244.9.200/32 -d 10.244.9.200/32 -j {n.MARK_MASQ}",
    ]
    full = FakeIptables()
    backend_on(full).sync(state, None)
    assert canonical(fake) == canonical(full)
