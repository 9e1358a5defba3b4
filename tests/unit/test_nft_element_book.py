"""The nftables backend's record of programmed elements: deltas, sharing, conflicts."""

from __future__ import annotations

from kpx_agent.backends.nftables.element_book import ElementBook


def test_first_plan_adds_everything_and_commit_records_it() -> None:
    book: ElementBook[str] = ElementBook()
    plan = book.plan({"a": [("m", "k1", "v1"), ("s", "k2", None)]})
    assert plan.add == {"m": [("k1", "v1")], "s": [("k2", None)]}
    assert plan.delete == {}
    assert len(book) == 0, "planning must not change the record"
    book.commit(plan)
    assert sorted(book.elements()) == [("m", "k1", "v1"), ("s", "k2", None)]


def test_unchanged_owner_plans_nothing() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("m", "k1", "v1")]}))
    assert not book.plan({"a": [("m", "k1", "v1")]})


def test_value_change_is_delete_then_add() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("m", "k1", "v1"), ("m", "k2", "v2")]}))
    plan = book.plan({"a": [("m", "k1", "v9"), ("m", "k2", "v2")]})
    assert plan.delete == {"m": ["k1"]}
    assert plan.add == {"m": [("k1", "v9")]}


def test_removed_owner_deletes_its_elements() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("m", "k1", "v1")], "b": [("m", "k2", "v2")]}))
    plan = book.plan({"a": None})
    assert plan.delete == {"m": ["k1"]} and plan.add == {}
    book.commit(plan)
    assert list(book.owners()) == ["b"]


def test_shared_element_stays_while_any_owner_wants_it() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("hairpin", "x", None)], "b": [("hairpin", "x", None)]}))
    assert len(book) == 1
    plan = book.plan({"a": None})
    assert not plan, "b still needs the element"
    book.commit(plan)
    plan = book.plan({"b": None})
    assert plan.delete == {"hairpin": ["x"]}


def test_conflicting_claim_keeps_the_first_and_takes_over_when_it_leaves() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("m", "vip", "goto a")]}))
    plan = book.plan({"b": [("m", "vip", "goto b")]})
    assert not plan and plan.conflicts == [(("m", "vip"), "b")]
    book.commit(plan)
    plan = book.plan({"a": None})
    assert plan.delete == {"m": ["vip"]} and plan.add == {"m": [("vip", "goto b")]}


def test_uncommitted_plan_leaves_the_record_as_the_kernel_has_it() -> None:
    book: ElementBook[str] = ElementBook()
    book.commit(book.plan({"a": [("m", "k1", "v1")]}))
    book.plan({"a": None, "b": [("m", "k2", "v2")]})  # the kernel refused it
    assert sorted(book.elements()) == [("m", "k1", "v1")]
    again = book.plan({"a": None})
    assert again.delete == {"m": ["k1"]}


def test_a_merged_set_holds_one_value_per_key_combined_across_owners() -> None:
    """Owners of one key in a merged set do not conflict: the kernel gets the merge of their
    values (here the smallest), whatever the order of their claims; a deletion carries the
    value it replaces."""
    book: ElementBook[str] = ElementBook({"fw": min})
    book.commit(book.plan({"a": [("fw", ("vip",), (8,))]}))
    plan = book.plan({"b": [("fw", ("vip",), (16,))]})
    assert not plan and not plan.conflicts  # min(8, 16): the kernel's value stays
    book.commit(plan)
    plan = book.plan({"a": None})  # the owner of the smaller value goes
    assert plan.delete == {"fw": [("vip",)]} and plan.replaced == {("fw", ("vip",)): (8,)}
    assert plan.add == {"fw": [(("vip",), (16,))]}
    book.commit(plan)
    assert list(book.elements()) == [("fw", ("vip",), (16,))]
    fresh: ElementBook[str] = ElementBook(book.merge)
    full = fresh.plan({"b": [("fw", ("vip",), (16,))], "a": [("fw", ("vip",), (8,))]})
    assert full.add == {"fw": [(("vip",), (8,))]} and not full.conflicts
