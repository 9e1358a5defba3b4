"""The bisection that finds the Services a kernel refuses (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from kpx_agent.sync.fault_isolation import find_culprits


class Kernel:
    """Refuses any ruleset holding one of `bad`, or both of a pair."""

    def __init__(self, *bad: int, pairs: Sequence[tuple[int, int]] = ()) -> None:
        self.bad, self.pairs = bad, pairs

    def __call__(self, included: Sequence[int]) -> str | None:
        for item in self.bad:
            if item in included:
                return f"refused {item}"
        for x, y in self.pairs:
            if x in included and y in included:
                return f"{x} and {y} clash"
        return None


def test_nothing_wrong_costs_one_check_after_the_good_part() -> None:
    found = find_culprits(list(range(10_000)), Kernel())
    assert found.isolated and found.culprits == {} and found.checks == 2


def test_single_culprits_among_ten_thousand_in_logarithmic_checks() -> None:
    found = find_culprits(list(range(10_000)), Kernel(4321, 77))
    assert found.culprits == {4321: "refused 4321", 77: "refused 77"}
    assert found.checks <= 2 + 2 * 2 * 14  # about 2 k log2(n)


def test_of_a_pair_refused_together_the_later_one_is_left_out() -> None:
    found = find_culprits([1, 2, 3, 4, 5], Kernel(pairs=[(2, 5)]))
    assert found.culprits == {5: "2 and 5 clash"}
    # What the kernel holds already comes first: a new Service clashing with it is left out.
    found = find_culprits([1], Kernel(pairs=[(1, 9)]), good=[9])
    assert found.culprits == {1: "1 and 9 clash"}


def test_a_fault_outside_the_items_isolates_nothing() -> None:
    found = find_culprits([1, 2, 3], lambda included: "the table itself")
    assert not found.isolated and found.culprits == {} and found.checks == 1


def test_the_budget_bounds_the_search() -> None:
    found = find_culprits(list(range(100)), Kernel(*range(0, 100, 2)), max_checks=20)
    assert not found.isolated and found.culprits == {} and found.checks == 20
