"""The backend's own record of the set and map elements it programmed.

Each element belongs to one or more owners (service ports). A shared element (a hairpin pair
used by two Services) stays while any owner wants it; a key claimed by two owners with different
values (two Services on one external IP and port) keeps the first claim and is logged (the model
settles VIP clashes before a backend sees them, vip_claims.py, so service ports never claim one
VIP twice). In a *merged* set the owners' values of one key are combined instead (`merge`: one
function per set name, of the values in claim order), so the kernel gets one value per key
whatever the order of the claims (the allowed source ranges of a load-balancer IP and port: see
`ruleset.common_ranges`). Updates are planned against the record without changing it, and
committed only once the kernel accepted them, so a failed transaction leaves the record equal
to what the kernel still has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Generic, TypeVar

from .schema import Element, Key, Value

Owner = TypeVar("Owner")
ElementKey = tuple[str, Key]  # (set name, typed key)
Merge = Callable[[Sequence[Value]], Value]  # the owners' values of one key -> the kernel's
#: The claims on one key, in claim order. Memory: a key has one owner but in rare cases (a
#: hairpin pair two Services share, a merged set's key), and a record holds 100,000+ keys at
#: 10,000 Services, so one claim is kept as its (owner, value) pair and only several as a list.
Claim = tuple[Owner, Value]
Claims = Claim[Owner] | list[Claim[Owner]]
#: The record of one family's table: set name -> key -> claims (no (set, key) pair per key).
Record = dict[str, dict[Key, Claims[Owner]]]


def claims_of(claims: Claims[Owner] | None) -> Sequence[Claim[Owner]]:
    """The claims on a key as a sequence (empty for none)."""
    if claims is None:
        return ()
    if type(claims) is list:
        return claims
    return (claims,)  # type: ignore[return-value]


#: An owner's elements as the record keeps them: for each run of elements of one set, in the
#: order given, the set name, the run's keys and its values (None when every value is None,
#: as in a plain set): `(name, keys, values, name, keys, values, ...)`. Memory: an element
#: costs two pointers here, not the 64 B tuple of its own it came as (100,000+ at 10,000
#: Services); the keys and values are the objects the record's claims hold anyway.
Contribution = tuple[object, ...]


def _set_of(element: Element) -> str:
    return element[0]


def runs_of(elements: Iterable[Element]) -> Contribution:
    """An owner's elements as kept (`Contribution`)."""
    out: list[object] = []
    for set_name, run in groupby(elements, _set_of):
        _, keys, values = zip(*run, strict=True)
        out += (set_name, keys, None if values.count(None) == len(values) else values)
    return tuple(out)


def elements_of(contribution: Contribution | None) -> Iterator[Element]:
    """The elements an owner gave, in order, from what the record kept (`runs_of`)."""
    if not contribution:
        return
    for i in range(0, len(contribution), 3):
        set_name, keys, values = contribution[i : i + 3]
        assert isinstance(set_name, str) and isinstance(keys, tuple)
        if values is None:
            yield from ((set_name, key, None) for key in keys)
        else:
            assert isinstance(values, tuple)
            yield from zip(repeat(set_name), keys, values)


def _stored(lst: list[Claim[Owner]]) -> Claims[Owner]:
    """How a key's claims are kept once committed (see `Claims`)."""
    return lst[0] if len(lst) == 1 else lst


@dataclass
class Plan(Generic[Owner]):
    """Element changes one sync makes: deletions before additions, per set."""

    delete: dict[str, list[Key]] = field(default_factory=dict)
    add: dict[str, list[tuple[Key, Value]]] = field(default_factory=dict)
    conflicts: list[tuple[ElementKey, Owner]] = field(default_factory=list)
    # The value each deleted key had in the kernel (to delete what a merged value expands to).
    replaced: dict[ElementKey, Value] = field(default_factory=dict)
    merge: Mapping[str, Merge] = field(default_factory=dict)
    # A full sync's plan (`claim_fresh`): the claims as the record keeps them. A partial
    # sync's plan (`ElementBook.plan`): working lists of the keys it touches.
    _owners: Record[Owner] = field(default_factory=dict)
    _contrib: dict[Owner, Contribution | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.delete or self.add)

    def claim_fresh(self, owner: Owner, elements: Iterable[Element] | None) -> list[Element]:
        """For a plan against an empty record, one owner at a time (so a full sync can stream
        its elements): take the owner's elements and return those whose key nobody claimed
        before. A key claimed again stays with its first claim (a different value is a
        conflict). Elements of merged sets are never returned: `merged_elements` has them
        once every owner has claimed."""
        new = tuple(elements) if elements is not None else ()
        self._contrib[owner] = runs_of(new) if elements is not None else None
        record = self._owners
        merge = self.merge
        first: list[Element] = []
        by_set: dict[Key, Claims[Owner]] | None = None
        by_set_name = None
        for element in new:
            set_name, key, value = element
            if set_name != by_set_name:
                by_set = record.get(set_name)
                if by_set is None:
                    by_set = record[set_name] = {}
                by_set_name = set_name
            assert by_set is not None
            claims = by_set.get(key)
            if claims is None:
                by_set[key] = (owner, value)
                if set_name not in merge:
                    first.append(element)
                continue
            if type(claims) is list:
                lst = claims
            else:
                lst = by_set[key] = [claims]  # type: ignore[list-item]
            if lst[0][1] != value and set_name not in merge:
                self.conflicts.append(((set_name, key), owner))
            lst.append((owner, value))
        return first

    def merged_elements(self) -> list[Element]:
        """The merged sets' elements of a plan made by `claim_fresh` (a full sync's)."""
        merge = self.merge
        return [
            (set_name, key, merge[set_name]([v for _, v in claims_of(claims)]))
            for set_name, by_set in self._owners.items()
            if set_name in merge
            for key, claims in by_set.items()
            if claims
        ]

    def effective(self, set_name: str, owners: Sequence[tuple[Owner, Value]]) -> Value:
        """The value the kernel holds for a key with these owners (in claim order)."""
        if set_name in self.merge:
            return self.merge[set_name]([v for _, v in owners])
        return owners[0][1]


#: For a set name: how many kernel elements one of its record elements is (by its value), or
#: None where each is one (`ElementBook.kernel_size`).
Sized = Callable[[str], Callable[[Value], int] | None]


class ElementBook(Generic[Owner]):
    def __init__(
        self, merge: Mapping[str, Merge] | None = None, sized: Sized | None = None
    ) -> None:
        self._owners: Record[Owner] = {}
        self._contrib: dict[Owner, Contribution] = {}
        self.merge: Mapping[str, Merge] = merge or {}
        self._sized = sized
        #: Kernel elements beyond one per record element (`kernel_size`), kept as commits go.
        self._extra = 0

    def new_plan(self) -> Plan[Owner]:
        return Plan(merge=self.merge)

    def __len__(self) -> int:
        """The record's elements."""
        return sum(len(by_set) for by_set in self._owners.values())

    def kernel_size(self) -> int:
        """The kernel elements the record stands for (`sized`: an element may be several)."""
        return len(self) + self._extra

    def _size_of(self, set_name: str) -> Callable[[Value], int] | None:
        return self._sized(set_name) if self._sized is not None else None

    def _extra_of(
        self, size: Callable[[Value], int], set_name: str, claims: Claims[Owner] | None
    ) -> int:
        """What a key with these claims adds to `kernel_size` beyond the one it counts."""
        if not claims:
            return 0
        return size(self.new_plan().effective(set_name, claims_of(claims))) - 1

    def elements(self) -> Iterator[Element]:
        """The record's effective elements (first owner's value wins, or the merged value; an
        element `sized` counts as several is one here)."""
        plan = self.new_plan()
        for set_name, by_set in self._owners.items():
            for key, claims in by_set.items():
                yield set_name, key, plan.effective(set_name, claims_of(claims))

    def contribution(self, owner: Owner) -> tuple[Element, ...]:
        return tuple(elements_of(self._contrib.get(owner)))

    def owners(self) -> Iterable[Owner]:
        return self._contrib.keys()

    def _claims(self, set_name: str, key: Key) -> Sequence[Claim[Owner]]:
        by_set = self._owners.get(set_name)
        return claims_of(by_set.get(key)) if by_set is not None else ()

    def plan(self, updates: Mapping[Owner, Iterable[Element] | None]) -> Plan[Owner]:
        """What changes in the kernel if each owner's elements become `updates[owner]`."""
        if not self._owners:
            return self._plan_fresh(updates)
        plan = self.new_plan()
        merge = self.merge
        staged = plan._owners  # working lists of the keys touched

        def working(set_name: str, key: Key) -> list[Claim[Owner]]:
            by_set = staged.setdefault(set_name, {})
            lst = by_set.get(key)
            if lst is None:
                lst = by_set[key] = list(self._claims(set_name, key))
            return lst  # type: ignore[return-value]

        for owner, new_elems in updates.items():
            old = tuple(elements_of(self._contrib.get(owner)))
            new = tuple(new_elems) if new_elems is not None else ()
            plan._contrib[owner] = runs_of(new) if new_elems is not None else None
            old_set, new_set = set(old), set(new)
            for set_name, key, value in old:
                if (set_name, key, value) in new_set:
                    continue
                lst = working(set_name, key)
                lst[:] = [(o, v) for o, v in lst if o != owner]
            for set_name, key, value in new:
                if (set_name, key, value) in old_set:
                    continue
                lst = working(set_name, key)
                if lst and lst[0][1] != value and lst[0][0] != owner and set_name not in merge:
                    plan.conflicts.append(((set_name, key), owner))
                lst.append((owner, value))
        for set_name, by_set in staged.items():
            for key, working_claims in by_set.items():
                now = claims_of(working_claims)
                before = self._claims(set_name, key)
                old_value = plan.effective(set_name, before) if before else None
                new_value = plan.effective(set_name, now) if now else None
                if before and (not now or new_value != old_value):
                    plan.delete.setdefault(set_name, []).append(key)
                    plan.replaced[(set_name, key)] = old_value
                if now and (not before or new_value != old_value):
                    plan.add.setdefault(set_name, []).append((key, new_value))
        return plan

    def _plan_fresh(self, updates: Mapping[Owner, Iterable[Element] | None]) -> Plan[Owner]:
        """The same plan for an empty record (a full sync), without the diffing."""
        plan = self.new_plan()
        for owner, new_elems in updates.items():
            for set_name, key, value in plan.claim_fresh(owner, new_elems):
                plan.add.setdefault(set_name, []).append((key, value))
        for set_name, key, value in plan.merged_elements():
            plan.add.setdefault(set_name, []).append((key, value))
        return plan

    def commit(self, plan: Plan[Owner]) -> None:
        """Record a plan the kernel accepted."""
        if not self._owners and not self._contrib:
            # Into an empty record (a full sync's plan, 100,000+ keys): take the plan's tables
            # over instead of copying them; a plan is spent once committed.
            for by_set in plan._owners.values():
                for key in [k for k, c in by_set.items() if type(c) is list]:
                    lst = by_set[key]
                    if lst:
                        by_set[key] = _stored(lst)  # type: ignore[arg-type]
                    else:
                        del by_set[key]
            self._owners = {name: by_set for name, by_set in plan._owners.items() if by_set}
            self._contrib = {owner: c for owner, c in plan._contrib.items() if c}
            plan._owners, plan._contrib = {}, {}
            self._extra = sum(
                self._extra_of(size, set_name, claims)
                for set_name, by_set in self._owners.items()
                if (size := self._size_of(set_name)) is not None
                for claims in by_set.values()
            )
            return
        for set_name, by_set in plan._owners.items():
            record = self._owners.setdefault(set_name, {})
            size = self._size_of(set_name)
            for key, claims in by_set.items():
                lst = list(claims_of(claims))
                if size is not None:
                    self._extra += self._extra_of(size, set_name, lst) - self._extra_of(
                        size, set_name, record.get(key)
                    )
                if lst:
                    record[key] = _stored(lst)
                else:
                    record.pop(key, None)
            if not record:
                del self._owners[set_name]
        for owner, contrib in plan._contrib.items():
            if contrib:
                self._contrib[owner] = contrib
            else:
                self._contrib.pop(owner, None)

    def clear(self) -> None:
        self._owners.clear()
        self._contrib.clear()
        self._extra = 0
