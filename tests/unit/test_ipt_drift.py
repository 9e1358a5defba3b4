"""The iptables backend's drift check against the kernel fake: iptables-save of each table,
our chains and jump rules compared with the record; a full sync repairs what differs."""

from __future__ import annotations

from backend_samples import SETTINGS, sample_state
from ipt_fake import FakeIptables

from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.localnet import NodeLocalState


def synced() -> tuple[FakeIptables, IptablesBackend, NodeLocalState]:
    fake = FakeIptables()
    backend = IptablesBackend(
        SETTINGS,
        restore=fake.restore,
        save=fake.save,
        chain_exists=fake.chain_exists,
        ensure_sysctl=lambda path, value: None,
    )
    state = sample_state()
    backend.sync(state, None)
    return fake, backend, state


def svc_chain(fake: FakeIptables, family: int = 4) -> str:
    nat = fake.tables[(family, "nat")]
    return next(c for c in sorted(nat) if c.startswith(n.SVC_PREFIX) and nat[c])


def test_a_freshly_synced_kernel_is_not_drift() -> None:
    _, backend, _ = synced()
    assert backend.drifted() == ""


def test_a_rule_deleted_behind_our_back_is_drift_and_a_full_sync_repairs_it() -> None:
    fake, backend, state = synced()
    expected = fake.dump()
    chain = svc_chain(fake)
    rules = fake.tables[(4, "nat")][chain]
    del rules[0]
    assert backend.drifted() == (
        f"IPv4 nat: chain {chain} has {len(rules)} rules, not the {len(rules) + 1} written"
    )
    backend.sync(state, None)
    assert fake.dump() == expected and backend.drifted() == ""


def test_a_rule_replaced_in_place_after_the_first_check_is_drift() -> None:
    fake, backend, state = synced()
    assert backend.drifted() == ""  # the digest of our chains as the sync left them
    fake.tables[(4, "nat")][svc_chain(fake)][0] = "-j RETURN"
    assert backend.drifted() == "IPv4 nat: a rule of ours was changed behind our back"
    backend.sync(state, None)
    assert backend.drifted() == "" and backend.drifted() == ""


def test_a_flushed_chain_a_foreign_rule_a_lost_jump_are_drift() -> None:
    fake, backend, state = synced()
    chain = svc_chain(fake, 6)
    fake.tables[(6, "nat")][chain].clear()
    assert backend.drifted().startswith(f"IPv6 nat: chain {chain} has 0 rules")
    backend.sync(state, None)
    fake.tables[(4, "nat")][svc_chain(fake)].append("-j ACCEPT")
    assert "rules, not the" in backend.drifted()
    backend.sync(state, None)
    prerouting = fake.tables[(4, "nat")]["PREROUTING"]
    prerouting.remove(next(r for r in prerouting if n.COMMENT in r))
    assert backend.drifted() == "IPv4 nat: our jump rules in PREROUTING differ"
    backend.sync(state, None)
    assert backend.drifted() == ""


def test_other_softwares_chains_and_rules_are_not_drift() -> None:
    fake, backend, _ = synced()
    fake.tables[(4, "nat")]["CNI-HOSTPORT"] = ["-j RETURN"]
    fake.tables[(4, "nat")]["PREROUTING"].append("-j CNI-HOSTPORT")
    assert backend.drifted() == ""
