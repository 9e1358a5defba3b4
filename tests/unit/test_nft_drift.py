"""The nftables backend's drift check against the kernel fake: the generation id says whether
anyone committed since the backend's last commit; a digest of its own tables, whether another
writer's commit touched them; and a full sync repairs what was changed behind its back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from backend_samples import SETTINGS, key, sample_state

from kpx_agent.backends.kernel.netlink import Message, attr
from kpx_agent.backends.kernel.nft_listing import NFT_MSG_NEWSET, message_type
from kpx_agent.backends.kernel.nft_query import Overtaken
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables, FakeTable
from kpx_agent.backends.nftables.netlink_query import NFTA_SET_COUNT, TableDigest
from kpx_agent.model.types import IP, NodeLocalState, Protocol

VIP = (IP.of("10.96.0.10"), Protocol.TCP, 80)


class Digests:
    """The fake's digest, counting how often the tables were read back."""

    def __init__(self, fake: FakeNftables) -> None:
        self.fake = fake
        self.reads = 0
        self.after_read: Callable[[], None] = lambda: None  # e.g. a commit, once read

    def __call__(self, family: int, still: Callable[[], bool] | None = None) -> bytes:
        if still is not None and not still():
            raise Overtaken()
        self.reads += 1
        digest = self.fake.digest(family)
        self.after_read()
        return digest


def synced() -> tuple[FakeNftables, NftablesBackend, NodeLocalState, Digests]:
    fake = FakeNftables()
    digests = Digests(fake)
    fake.table_digest = digests  # type: ignore[method-assign]  # counts the reads
    backend = NftablesBackend(SETTINGS, fake)
    state = sample_state()
    backend.sync(state, None)
    return fake, backend, state, digests


def delete_vip(tables: dict[int, FakeTable]) -> None:
    del tables[4].sets[n.CLUSTER_IPS].elements[VIP]


def test_an_untouched_kernel_is_not_drift_and_is_read_back_once() -> None:
    _, backend, _, digests = synced()
    assert backend.drifted() == ""
    assert digests.reads == 2  # the digest of both tables, taken while they hold our commit
    assert backend.drifted() == "" and backend.drifted() == ""
    assert digests.reads == 2  # generation unchanged: nothing read back again


def test_an_element_deleted_behind_our_back_is_drift_and_a_full_sync_repairs_it() -> None:
    fake, backend, state, _ = synced()
    expected = fake.dump()
    assert backend.drifted() == ""
    fake.edit(delete_vip)
    assert "ip table changed behind our back" in backend.drifted()
    backend.sync(state, None)  # what the agent's periodic check then asks for
    assert fake.dump() == expected
    assert backend.drifted() == ""


def test_a_flushed_chain_is_drift() -> None:
    fake, backend, _, _ = synced()
    assert backend.drifted() == ""
    chain = next(c for c in fake.tables[6].chains.values() if c.rules)
    fake.edit(lambda _: chain.rules.clear())
    assert "ip6 table changed" in backend.drifted()


def test_another_writers_commit_elsewhere_is_not_drift() -> None:
    fake, backend, _, digests = synced()
    assert backend.drifted() == ""
    fake.edit()  # e.g. iptables-nft or a CNI plugin committed to its own table
    assert backend.drifted() == ""
    reads = digests.reads
    assert backend.drifted() == "" and digests.reads == reads  # that generation is known now


def test_our_commit_and_another_writers_before_a_check_cannot_be_told_apart() -> None:
    """The backend committed (its digest of the tables is gone with it) and so did another
    writer before the check: the tables cannot be verified, so the agent rewrites them."""
    fake, backend, state, _ = synced()
    assert backend.drifted() == ""
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=web.cluster_endpoints[:1])
    backend.sync(state, [web.key])
    fake.edit()
    assert "another writer committed" in backend.drifted()


def test_a_change_behind_our_back_before_our_next_partial_sync_is_still_found() -> None:
    """The damage comes first, then the backend's own partial sync (which moves the generation
    on too): the generation it saw before its commit tells it someone else committed."""
    fake, backend, state, _ = synced()
    expected_vip = fake.elements(4, n.CLUSTER_IPS)[VIP]
    assert backend.drifted() == ""
    fake.edit(delete_vip)
    web6 = state.services[key("web6", family=6)]
    state.services[web6.key] = dataclasses.replace(web6, port=81)
    backend.sync(state, [web6.key])  # a partial sync of another Service
    assert backend.drifted() != ""
    backend.sync(state, None)
    assert fake.elements(4, n.CLUSTER_IPS)[VIP] == expected_vip


def test_a_generation_that_cannot_be_read_is_no_drift() -> None:
    fake = FakeNftables()

    def unreadable() -> int:
        raise PermissionError(1, "Operation not permitted")

    fake.generation = unreadable  # type: ignore[method-assign]
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(sample_state(), None)
    fake.edit(delete_vip)
    assert backend.drifted() == ""  # not known: the hourly full sync still comes


def test_a_sync_that_sends_nothing_keeps_the_digest() -> None:
    """A partial sync with nothing to program commits nothing: the digest taken before still
    describes the tables, so a later foreign change is still compared with it."""
    fake, backend, state, digests = synced()
    assert backend.drifted() == ""
    reads = digests.reads
    backend.sync(state, [key("web")])  # unchanged: no transaction
    fake.edit()
    assert backend.drifted() == ""  # verified against the digest, not "cannot tell"
    assert digests.reads == reads + 2


def fewer_web_endpoints(backend: NftablesBackend, state: NodeLocalState) -> None:
    """A partial sync of ours that commits (the web Service loses an endpoint)."""
    web = state.services[key("web")]
    state.services[web.key] = dataclasses.replace(web, cluster_endpoints=web.cluster_endpoints[:1])
    backend.sync(state, [web.key])


def test_a_reading_is_used_while_nothing_committed_since_and_not_read_again() -> None:
    """The dump runs while syncs go on (`read_kernel`); judged with nothing committed since,
    its digests stand for the kernel: the baseline is taken from it, and a later reading
    finds a change behind our back, with one dump each."""
    fake, backend, _, digests = synced()
    reading = backend.read_kernel()
    assert digests.reads == 2
    assert backend.drifted(reading) == "" and digests.reads == 2  # the baseline, from it
    fake.edit(delete_vip)
    reading = backend.read_kernel()
    assert digests.reads == 4
    assert "ip table changed behind our back" in backend.drifted(reading)
    assert digests.reads == 4


def test_a_reading_a_commit_of_ours_overtook_is_not_taken_for_drift_nor_baseline() -> None:
    """Our own partial sync commits after the dump: the reading shows the tables before it.
    Judged anyway, it would be a baseline of the past (and the next check would take our
    sync for another writer's change): it is left to the next check instead."""
    fake, backend, state, digests = synced()
    reading = backend.read_kernel()
    fewer_web_endpoints(backend, state)
    assert backend.drifted(reading) == ""
    reads = digests.reads
    assert backend.drifted() == "" and digests.reads == reads + 2  # the baseline, read now
    fake.edit()  # another writer, elsewhere
    assert backend.drifted() == ""  # compared with the baseline of our last commit
    # The stale reading's digests are not those of our last commit: as the baseline, the
    # last check would have taken our own sync for a change behind our back.
    assert reading is not None and reading.digests != {4: fake.digest(4), 6: fake.digest(6)}


def test_a_read_that_a_commit_overtakes_stops_at_once_and_is_not_used() -> None:
    """A commit while our tables are read back (our next sync, under churn): the digest it
    reads is of no generation, so the read stops at the next question, not after dumping
    every table (seconds at 30,000 Services); the next check reads again."""
    _, backend, state, digests = synced()
    # our next sync commits right after the first table is read
    digests.after_read = lambda: fewer_web_endpoints(backend, state)
    reading = backend.read_kernel()
    assert digests.reads == 1  # the second table was not read
    assert reading is not None and reading.digests is None
    digests.after_read = lambda: None
    assert backend.drifted(reading) == "" and digests.reads == 1  # nothing taken from it
    assert backend.drifted() == "" and digests.reads == 3  # the next check reads both again


def test_a_change_behind_our_back_during_the_read_is_found_by_the_next_check() -> None:
    fake, backend, _, _ = synced()
    assert backend.drifted() == ""
    fake.edit()  # a foreign commit: the next reading dumps our tables
    reading = backend.read_kernel()
    fake.edit(delete_vip)  # and the damage lands after that dump
    assert backend.drifted(reading) == ""  # the reading is of another generation
    assert "ip table changed behind our back" in backend.drifted()


def _set_message(name: str, flags: int, count: int | None) -> Message:
    body = b"\x02\x00\x00\x00"  # nfgenmsg: AF_INET, version, resource id
    body += attr(1, b"kpx\0") + attr(2, name.encode() + b"\0")
    body += attr(3, flags.to_bytes(4, "big"))
    if count is not None:
        body += attr(NFTA_SET_COUNT, count.to_bytes(4, "big"))
    return Message(message_type(NFT_MSG_NEWSET), 0, 0, body, 0)


def _digest(*messages: Message) -> bytes:
    digest = TableDigest()
    for message in messages:
        digest.add(message)
    return digest.digest()


def test_the_digest_leaves_out_a_sets_element_count_not_its_definition() -> None:
    """Recent kernels (6.18 here) put a set's element count in its definition: a client recorded in
    an affinity set changes it, and that is no drift; a set's flags changed are."""
    recorded = _digest(_set_message("aff-x", 0x14, 1))
    assert _digest(_set_message("aff-x", 0x14, 0)) == recorded
    assert _digest(_set_message("aff-x", 0x14, None)) == recorded  # older kernels
    assert _digest(_set_message("aff-x", 0x04, 1)) != recorded
    assert _digest(_set_message("aff-y", 0x14, 1)) != recorded


def test_only_the_affinity_sets_are_the_data_paths() -> None:
    affinity = n.affinity_set(key("sticky"), 10800, IP.of("10.244.1.2"), 8080)
    assert n.is_affinity_set(affinity)
    assert not any(
        n.is_affinity_set(name)
        for name in (n.SERVICE_IPS, "endpoints-2", "aff-abc", f"{affinity}-x", f"x{affinity}")
    )
