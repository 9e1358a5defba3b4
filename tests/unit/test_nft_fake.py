"""The nftables kernel fake refuses what the kernel refuses, atomically; and any sequence of
partial syncs leaves it as one full sync of the final state would (a property test with a
fixed seed)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
from backend_samples import SETTINGS, sample_state

from kpx_agent.backends.kernel.nft_rules import Jump, Lookup, Verdict, rule, vip_key
from kpx_agent.backends.kernel.nft_transaction import AddRule, Transaction
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeError, FakeNftables
from kpx_agent.backends.nftables.schema import Field, Goto, SetDecl
from kpx_agent.model.types import IP, Endpoint, NodeLocalState, Protocol, ServicePort

TCP = Protocol.TCP
ip = IP.of


def synced() -> tuple[FakeNftables, NftablesBackend, NodeLocalState]:
    fake = FakeNftables()
    backend = NftablesBackend(SETTINGS, fake)
    state = sample_state()
    backend.sync(state, None)
    return fake, backend, state


def refused(fake: FakeNftables, build: Callable[[Transaction], None], reason: str) -> None:
    before = fake.dump()
    txn = Transaction(4, n.TABLE)
    build(txn)
    with pytest.raises(FakeError, match=reason):
        fake.run_transactions([txn])
    assert fake.dump() == before  # nothing of a refused transaction is applied


def test_the_backend_programs_the_fake_cold_and_warm() -> None:
    fake, backend, state = synced()
    cold = fake.dump()
    assert backend.last_loaded  # no table: the elements went by the (faked) netlink load
    backend.sync(state, None)  # the tables are there now: one nft transaction swaps them
    assert not backend.last_loaded and fake.dump() == cold
    assert (ip("10.96.0.10"), TCP, 80) in fake.elements(4, n.CLUSTER_IPS)


def test_references_types_and_duplicates_are_checked_as_the_kernel_does() -> None:
    fake, _, _ = synced()
    vip = (ip("10.96.0.99"), TCP, 80)
    refused(fake, lambda t: t.ops.append(AddRule("services", rule(Jump("nowhere")))), "nowhere")
    refused(fake, lambda t: t.add_elements("no-such-set", [(vip, None)]), "no such set")
    # A verdict map looked up as a set: Linux 6.1 refuses the rule (EINVAL). The typed
    # vocabulary refuses to build it (test_nft_rules); a rule whose declaration says "set"
    # where the table holds the map of that name is refused by the fake, which resolves the
    # name as the kernel does.
    as_set = SetDecl(n.SERVICE_IPS, (Field.ADDR, Field.PROTO, Field.PORT))
    lookup = rule(Lookup(vip_key(4), as_set), Verdict.ACCEPT)
    refused(fake, lambda t: t.ops.append(AddRule("services", lookup)), "looked up as a set")
    refused(
        fake,
        lambda t: t.add_elements(n.CLUSTER_IPS, [((ip("fd00::1"), TCP, 80), None)]),
        "wrong type",
    )
    refused(
        fake,
        lambda t: t.add_elements(n.CLUSTER_IPS, [((ip("10.0.0.1"), "tcp", 80), None)]),
        "wrong type",
    )
    refused(fake, lambda t: t.add_elements(n.SERVICE_IPS, [(vip, Goto("no-chain"))]), "no-chain")
    refused(fake, lambda t: t.delete_elements(n.CLUSTER_IPS, [vip]), "ENOENT")
    taken = (ip("10.96.0.10"), TCP, 80)  # dispatched to endpoints-2 already
    refused(fake, lambda t: t.add_elements(n.SERVICE_IPS, [(taken, Goto("endpoints-1"))]), "EEXIST")
    refused(fake, lambda t: t.delete_chain("endpoints-2"), "still used")
    refused(fake, lambda t: t.add_port_chain("x", [SetDecl(n.HAIRPIN, ())], []), "another")
    # Part of a transaction refused: none of it applies (the first op alone would be fine).
    refused(
        fake,
        lambda t: (t.add_elements(n.CLUSTER_IPS, [(vip, None)]), t.delete_set("no-such-set")),
        "no such set",
    )
    # The same element again, same value: the kernel accepts it (no NLM_F_EXCL).
    same = Transaction(4, n.TABLE)
    same.add_elements(n.SERVICE_IPS, [(taken, Goto("endpoints-2"))])
    fake.run_transactions([same])


def canonical(fake: FakeNftables) -> str:
    """The dump without the endpoint chains and maps that are empty: a partial sync creates
    the chain and map of a new endpoint count and keeps them when no longer used (matching
    nothing: a dispatch to an empty map would show in the dispatch maps' elements)."""
    for table in fake.tables.values():
        for name in [k for k, s in table.sets.items() if not s.elements]:
            if n.endpoint_count_of(name) is not None:
                del table.sets[name]
                del table.chains[name]
    return fake.dump()


def mutate(rng: random.Random, sp: ServicePort) -> ServicePort:
    """One random change of a service port: endpoints, addresses, policies, affinity. Its
    addresses and ports are its own (two Services claiming one key keep the first claim,
    which depends on the order of the syncs; see element_book)."""
    own = sum(map(ord, sp.key.name)) % 50
    pool = [Endpoint(ip(f"10.244.{i % 3 + 1}.{i + 2}"), 8080, i % 3 == 0) for i in range(6)]
    eps = tuple(rng.sample(pool, rng.randrange(0, 4)))
    choice = rng.randrange(6)
    if choice == 0:
        return dataclasses.replace(sp, cluster_endpoints=eps, external_endpoints=eps)
    if choice == 1:
        return dataclasses.replace(sp, external_endpoints=eps)
    if choice == 2:
        return dataclasses.replace(sp, affinity_timeout=rng.choice((0, 0, 60)))
    if choice == 3:
        return dataclasses.replace(sp, node_port=rng.choice((0, 30100 + own, 30200 + own)))
    if choice == 4:
        return dataclasses.replace(
            sp,
            load_balancer_ips=rng.choice(((), (ip(f"192.0.2.{100 + own}"),))),
            external_masquerade=True,
        )
    return dataclasses.replace(
        sp, external_ips=rng.choice(((), (ip(f"192.0.2.{150 + own}"),), (ip(f"198.51.100.{own}"),)))
    )


def kernel_elements(fake: FakeNftables) -> int:
    """The fake kernel's elements of the Services, as the backend counts them: a
    `firewall-allow` allow list (one interval element per range in the kernel) counts as one,
    per firewalled address; the node's own sets are not the Services' (and an affinity set
    fills with traffic)."""
    node_sets = {n.NODEPORT_ADDRESSES, n.LOCAL_POD_CIDRS, n.FIREWALL_ALLOW}
    return sum(
        len(fake_set.elements)
        for table in fake.tables.values()
        for name, fake_set in table.sets.items()
        if name not in node_sets and not name.startswith("aff-")
    ) + sum(len(t.sets[n.FIREWALL_IPS].elements) for t in fake.tables.values())


@pytest.mark.parametrize("seed", range(8))
def test_partial_syncs_end_where_one_full_sync_of_the_final_state_does(seed: int) -> None:
    rng = random.Random(seed)
    fake, backend, state = synced()
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
        # the count the agent reports (kpx_programmed_elements) is the kernel's, sync after sync
        assert backend.element_count() == kernel_elements(fake)
    full = FakeNftables()
    NftablesBackend(SETTINGS, full).sync(state, None)
    assert canonical(fake) == canonical(full)
