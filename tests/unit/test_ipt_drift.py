"""The iptables backend's drift check against the kernel fake: iptables-save of each table,
our chains and jump rules compared with the record; a full sync repairs what differs."""

from __future__ import annotations

import dataclasses

from backend_samples import SETTINGS, endpoints, key, sample_state

from kpx_agent.backends.iptables import names as n
from kpx_agent.backends.iptables.backend import IptablesBackend, SavedTables
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.model.types import NodeLocalState


class Generation:
    """The nftables ruleset generation id as iptables-nft moves it (None: legacy iptables)."""

    def __init__(self, fake: FakeIptables | None) -> None:
        self.fake = fake
        self.foreign = 0  # commits of other writers

    def __call__(self) -> int | None:
        return None if self.fake is None else self.fake.commits + self.foreign


class CountingSave:
    def __init__(self, fake: FakeIptables) -> None:
        self.save = fake.save
        self.calls = 0

    def __call__(self, family: int, table: str) -> str:
        self.calls += 1
        return self.save(family, table)


def synced(
    nft_flavour: bool = False,
) -> tuple[FakeIptables, IptablesBackend, NodeLocalState, Generation, CountingSave]:
    fake = FakeIptables()
    generation = Generation(fake if nft_flavour else None)
    save = CountingSave(fake)
    fake.save = save  # type: ignore[method-assign]  # counts the reads
    fake.generation = generation  # type: ignore[method-assign]
    backend = IptablesBackend(SETTINGS, fake, ensure_sysctl=lambda path, value: None)
    state = sample_state()
    backend.sync(state, None)
    return fake, backend, state, generation, save


def svc_chain(fake: FakeIptables, family: int = 4) -> str:
    nat = fake.tables[(family, "nat")]
    return next(c for c in sorted(nat) if c.startswith(n.SVC_PREFIX) and nat[c])


def test_a_freshly_synced_kernel_is_not_drift() -> None:
    _, backend, _, _, _ = synced()
    assert backend.drifted() == ""


def test_a_rule_deleted_behind_our_back_is_drift_and_a_full_sync_repairs_it() -> None:
    fake, backend, state, _, _ = synced()
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
    fake, backend, state, _, _ = synced()
    assert backend.drifted() == ""  # the digest of our chains as the sync left them
    fake.tables[(4, "nat")][svc_chain(fake)][0] = "-j RETURN"
    assert backend.drifted() == "IPv4 nat: a rule of ours was changed behind our back"
    backend.sync(state, None)
    assert backend.drifted() == "" and backend.drifted() == ""


def test_a_flushed_chain_a_foreign_rule_a_lost_jump_are_drift() -> None:
    fake, backend, state, _, _ = synced()
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
    fake, backend, _, _, _ = synced()
    fake.tables[(4, "nat")]["CNI-HOSTPORT"] = ["-j RETURN"]
    fake.tables[(4, "nat")]["PREROUTING"].append("-j CNI-HOSTPORT")
    assert backend.drifted() == ""


def test_with_iptables_nft_an_unmoved_generation_reads_nothing_back() -> None:
    """iptables-nft: every restore is an nftables commit. While the generation id has not
    moved since the chains were verified, the check runs no iptables-save; once another writer
    committed, it reads them back again (and finds the change)."""
    fake, backend, _, generation, save = synced(nft_flavour=True)
    assert backend.drifted() == ""  # verified: the digest is taken
    saves = save.calls
    assert backend.drifted() == "" and backend.drifted() == ""
    assert save.calls == saves  # nothing committed: nothing read
    generation.foreign += 1  # another writer's commit, elsewhere
    assert backend.drifted() == ""
    assert save.calls > saves
    saves = save.calls
    assert backend.drifted() == "" and save.calls == saves  # that generation is verified now
    fake.tables[(4, "nat")][svc_chain(fake)][0] = "-j RETURN"
    generation.foreign += 1
    assert backend.drifted() == "IPv4 nat: a rule of ours was changed behind our back"


def test_legacy_iptables_reads_back_at_every_check() -> None:
    _, backend, _, _, save = synced(nft_flavour=False)
    backend.drifted()
    saves = save.calls
    backend.drifted()
    assert save.calls == saves + 4  # no generation to tell: both tables of both families


def test_after_only_our_own_syncs_nothing_is_read_back_until_a_quiet_check() -> None:
    """A node under constant change: every generation step since the chains were verified is
    one of our syncs' transactions, so no check reads back (at 30,000 Services a read-back
    took 15 s, and held up the changes); the first check with no commit since the one before
    takes the digest; a foreign commit makes the next check read and find what it changed."""
    fake, backend, state, generation, save = synced(nft_flavour=True)

    def reads() -> int:
        """iptables-save runs of one drift check (a full sync reads the tables too)."""
        before = save.calls
        assert backend.drifted() == ""
        return save.calls - before

    assert reads() > 0  # the first check after the first sync verifies the chains
    for _ in range(3):
        backend.sync(state, None)  # a full sync of ours: both families, both tables
        assert reads() == 0, "a check read back after our own sync"
    assert reads() > 0  # quiet since the last check: the digest is taken now
    assert reads() == 0
    backend.sync(state, None)
    generation.foreign += 1  # another writer's commit, here one that deletes a rule of ours
    chain = svc_chain(fake)
    del fake.tables[(4, "nat")][chain][0]
    assert backend.drifted().startswith(f"IPv4 nat: chain {chain} has ")


def test_a_foreign_commit_during_our_sync_is_not_taken_for_ours() -> None:
    """The generation moved by more than our transactions: the next check reads back."""
    fake, backend, state, generation, save = synced(nft_flavour=True)
    assert backend.drifted() == ""
    restore = fake.restore

    def restore_beside_another_writer(family: int, script: str) -> None:
        restore(family, script)
        generation.foreign += 1

    fake.restore = restore_beside_another_writer  # type: ignore[method-assign]
    backend.sync(state, None)
    fake.restore = restore  # type: ignore[method-assign]
    saves = save.calls
    assert backend.drifted() == ""
    assert save.calls > saves


def test_commits_of_counts_the_table_sections_that_change_something() -> None:
    from kpx_agent.backends.iptables.backend import commits_of

    assert commits_of("*nat\n:KPX-A - [0:0]\n-A KPX-A -j RETURN\nCOMMIT\n") == 1
    assert commits_of("*nat\n:KPX-A - [0:0]\nCOMMIT\n*filter\n-X KPX-B\nCOMMIT\n") == 2
    assert commits_of("*nat\nCOMMIT\n*filter\n:KPX-B - [0:0]\nCOMMIT\n") == 1
    assert commits_of("") == 0
    assert commits_of("*nat\nCOMMIT") == 0 and commits_of("*filter\n-X KPX-B\nCOMMIT") == 1


def with_web_endpoints(state: NodeLocalState, *ips: str) -> NodeLocalState:
    """`state` with the web Service's endpoints replaced (its chains rewritten, others not)."""
    web = key("web")
    eps = endpoints(*ips)
    services = dict(state.services)
    services[web] = dataclasses.replace(
        services[web], cluster_endpoints=eps, external_endpoints=eps
    )
    return dataclasses.replace(state, services=services)


def test_a_reading_taken_before_a_partial_sync_is_judged_without_the_chains_it_rewrote() -> None:
    """The read-back runs while syncs go on (seconds at 10,000 Services): a sync that
    rewrote chains after the read is not drift (the reading shows them as they were), and a
    chain changed behind our back that the sync did not touch is still found."""
    for nft_flavour in (False, True):
        fake, backend, state, generation, _ = synced(nft_flavour)
        assert backend.drifted() == ""
        generation.foreign += 1  # (iptables-nft reads back only after another writer's commit)
        reading = backend.read_kernel()  # two endpoints join the web Service after it
        assert isinstance(reading, SavedTables) and reading.saved is not None
        bigger = with_web_endpoints(state, "10.244.1.2", "10.244.2.2", "10.244.3.2", "10.244.4.2")
        backend.sync(bigger, {key("web")})
        nat = fake.tables[(4, "nat")]
        stale = {c for c, rules in reading.saved[(4, "nat")].rules.items() if rules != nat[c]}
        assert stale or set(nat) - set(reading.saved[(4, "nat")].rules)  # it is out of date
        assert backend.drifted(reading) == ""
        other = svc_chain(fake, 6)
        del fake.tables[(6, "nat")][other][0]  # behind our back
        generation.foreign += 1
        reading = backend.read_kernel()
        backend.sync(state, {key("web")})  # and a sync of ours rewrites web's chains
        assert backend.drifted(reading).startswith(f"IPv6 nat: chain {other} has ")


def test_a_reading_that_starts_during_a_sync_leaves_out_what_that_sync_rewrites() -> None:
    """The check's read may begin while a sync is between noting its chains and restoring
    them: those count as rewritten too."""
    fake, backend, state, _, _ = synced()
    restore = fake.restore
    readings: list[object] = []

    def read_then_restore(family: int, script: str) -> None:
        readings.append(backend.read_kernel())  # the read sees the kernel before the restore
        restore(family, script)

    fake.restore = read_then_restore  # type: ignore[method-assign]
    bigger = with_web_endpoints(state, "10.244.1.2", "10.244.2.2", "10.244.3.2")
    backend.sync(bigger, {key("web")})
    fake.restore = restore  # type: ignore[method-assign]
    [reading] = readings
    assert isinstance(reading, SavedTables)
    assert backend.drifted(reading) == ""
    assert backend.drifted() == ""  # and the next check reads the kernel as it is now


def test_a_reading_overlapped_by_a_full_sync_finds_nothing_and_the_next_check_reads_again() -> None:
    fake, backend, state, generation, save = synced(nft_flavour=True)
    assert backend.drifted() == ""
    chain = svc_chain(fake)
    del fake.tables[(4, "nat")][chain][0]  # another writer's commit
    generation.foreign += 1
    reading = backend.read_kernel()
    assert isinstance(reading, SavedTables) and reading.saved is not None  # it shows the loss
    backend.sync(state, None)  # rewrites everything, the deleted rule too
    assert backend.drifted(reading) == ""
    saves = save.calls
    assert backend.drifted() == "" and save.calls > saves  # read back, and found as written


def test_no_digest_is_taken_from_a_reading_a_sync_overlapped() -> None:
    """A digest stands for the kernel as our last sync left it: one taken from a reading that
    predates a sync would make the next check take that sync's chains for changed ones."""
    fake, backend, state, _, _ = synced()
    reading = backend.read_kernel()
    bigger = with_web_endpoints(state, "10.244.1.2", "10.244.2.2", "10.244.3.2")
    backend.sync(bigger, {key("web")})
    assert backend.drifted(reading) == ""
    assert backend.drifted() == "" and backend.drifted() == ""
    fake.tables[(4, "nat")][svc_chain(fake)][0] = "-j RETURN"
    assert backend.drifted() == "IPv4 nat: a rule of ours was changed behind our back"
