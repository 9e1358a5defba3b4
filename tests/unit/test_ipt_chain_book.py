"""The iptables backend's record of programmed chains: chain-level deltas and shared chains.

Rules go in typed; the record holds them as written (`-j X` for `rule(target=Jump("X"))`)."""

from __future__ import annotations

from kpx_agent.backends.iptables.chain_book import ChainBook
from kpx_agent.backends.iptables.rule import Jump, Rule, rule
from kpx_agent.backends.iptables.rules import PortLines, PortRules
from kpx_agent.model.types import Protocol, ServicePortKey

SHARED = ("nat", "KPX-SERVICES")


def k(name: str) -> ServicePortKey:
    return ServicePortKey("ns", name, "", Protocol.TCP, 4)


def j(chain: str) -> Rule:
    return rule(target=Jump(chain))


def book() -> ChainBook:
    return ChainBook(
        {("nat", "KPX-MARK-MASQ"): (j("MARK"),)}, {SHARED: ((j("head"),), (j("tail"),))}
    )


def rules(name: str, *own: str) -> PortLines:
    return PortRules(
        own={("nat", f"KPX-SVC-{name}"): tuple(map(j, own)) or (j("X"),)},
        shared={SHARED: (j(f"d-{name}"),)},
    ).lines()


def test_fresh_book_holds_the_fixed_and_framed_chains() -> None:
    b = book()
    assert b.chains == {("nat", "KPX-MARK-MASQ"): ("-j MARK",), SHARED: ("-j head", "-j tail")}


def test_plan_does_not_change_the_record_until_committed() -> None:
    b = book()
    plan = b.plan({k("b"): rules("b"), k("a"): rules("a")})
    assert b.chains[SHARED] == ("-j head", "-j tail") and not b.owners()
    assert plan.changes[SHARED] == ("-j head", "-j d-a", "-j d-b", "-j tail")  # owners in key order
    assert plan.tables() == ["nat"]
    b.commit(plan)
    assert b.chains[("nat", "KPX-SVC-a")] == ("-j X",) and len(b) == 4


def test_only_changed_chains_are_planned() -> None:
    b = book()
    b.commit(b.plan({k("a"): rules("a"), k("b"): rules("b")}))
    plan = b.plan({k("a"): rules("a", "Y")})
    assert plan.changes == {("nat", "KPX-SVC-a"): ("-j Y",)}  # the shared chain is the same
    assert not b.plan({k("a"): rules("a")})


def test_removal_deletes_owned_chains_and_recomposes_shared_ones() -> None:
    b = book()
    b.commit(b.plan({k("a"): rules("a"), k("b"): rules("b")}))
    plan = b.plan({k("a"): None})
    assert plan.changes == {("nat", "KPX-SVC-a"): None, SHARED: ("-j head", "-j d-b", "-j tail")}
    b.commit(plan)
    assert b.owners() == [k("b")] and ("nat", "KPX-SVC-a") not in b.chains


def test_revert_gives_back_the_recorded_content() -> None:
    b = book()
    b.commit(b.plan({k("a"): rules("a")}))
    plan = b.plan({k("a"): None, k("c"): rules("c")})
    undo = b.revert(plan, "nat")
    assert undo == {
        "KPX-SVC-a": ("-j X",),
        "KPX-SVC-c": None,
        "KPX-SERVICES": ("-j head", "-j d-a", "-j tail"),
    }
    assert b.revert(plan, "filter") == {}
