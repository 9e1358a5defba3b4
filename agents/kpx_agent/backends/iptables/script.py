"""`iptables-restore --noflush` scripts, and reading `iptables-save` output (both pure).

A script writes rules as the backend's record holds them, serialized from typed rules
(`rule.Rule.text`), each as `-A CHAIN <text>`. The jump edits in built-in chains delete rules
by the text iptables-save printed, and insert ours by their text.

A script holds one table. Declaring `:CHAIN - [0:0]` creates the chain or flushes it, so a
script first declares every chain it touches, then edits the jump rules in the built-in
chains, appends the rules of the chains it writes, and finally deletes (`-X`) the chains it
removes, when nothing jumps to them any more. Chains it does not name are left alone. A large
full sync lists the table (`-S`, output discarded) right after its jump edits, and declares
the chains they do not name after it: see `LIST_FIRST`. A full sync's nat table is written
in pieces that the tool reads while the rest is rendered (`streamed_table_script`): there
each service port's chains are declared just before their rules.
"""

from __future__ import annotations

import hashlib
import itertools
import shlex
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from . import names as n
from .rules import Lines

#: iptables-nft 1.8 (measured: 1.8.9) keeps the name of every chain a restore's lines name in
#: a list sorted by name (the chains its cache must fetch), and looks each line's chain up in
#: it from the start, one strcmp per name: a cost of chains x lines, 4 of the 8 s its restore
#: of 10,000 Services (10,000 chains, 120,000 lines) took on this project's machine, and 10 of
#: 50 s at 30,000. A line that names no chain makes it fetch the whole table instead and keep
#: no list from there on: `-S` (list the table's rules, whose output the backend discards) is
#: such a line that changes nothing. Where it goes matters (measured): a built-in chain that
#: does not exist yet (iptables-nft creates them on first use) is created for a line before
#: the listing, but a line after it finds the listing's stand-in for the chain and fails
#: (ENOENT); and the listing pays again for every chain declared before it, one by one against
#: all of them (30,000 declarations before it: 38 s). So the jump edits come first, with only
#: the chains they name declared before them, then the listing, then everything else: 3.5-4.0
#: s at 10,000 and 12 s at 30,000. Listing costs about 20 us per rule already in the table, and a
#: scan step about 3.5 ns: a full sync lists first where its chains x lines outweigh the
#: table's rules that many times.
LIST_FIRST = "-S"
SCAN_STEPS_PER_LISTED_RULE = 6_000
LIST_FIRST_MIN_CHAINS = 100


def lists_first(chains: int, lines: int, rules_in_table: int) -> bool:
    """Whether a restore that names `chains` chains in `lines` lines, into a table that holds
    `rules_in_table` rules, is cheaper with the table listed before its rules (`LIST_FIRST`;
    iptables-nft)."""
    return (
        chains >= LIST_FIRST_MIN_CHAINS
        and chains * lines >= SCAN_STEPS_PER_LISTED_RULE * rules_in_table
    )


#: Shared chains whose rules do not depend on their order (each matches its own addresses):
#: a partial sync changes them rule by rule (`-D`, `-A`) where that is shorter than rewriting
#: them. KPX-HAIRPIN has a rule per local endpoint address (12,534 at 10,000 Services in the
#: benchmark's workload): written whole, one local endpoint's change was a 0.9 MB restore of
#: 0.45 s. A `-D` makes iptables-nft fetch that chain's rules: about 0.1 s for 12,500 rules,
#: 0.01 s for a chain of ten (measured, iptables-nft 1.8.9).
ORDER_FREE = frozenset({n.HAIRPIN})


def rule_edits(old: Lines, new: Lines) -> tuple[Lines, Lines] | None:
    """For an order-free chain holding `old`: the rules to delete and to append so that it
    holds `new`'s rules (in another order), when that is fewer lines than writing `new` whole
    (None: write it whole)."""
    old_set, new_set = set(old), set(new)
    if len(old_set) != len(old) or len(new_set) != len(new):
        return None  # (duplicates: composed chains have none)
    gone = tuple(r for r in old if r not in new_set)
    added = tuple(r for r in new if r not in old_set)
    return (gone, added) if len(gone) + len(added) < len(new) else None


def table_script(
    table: str,
    changes: Mapping[str, Lines | None],
    jump_edits: Sequence[str] = (),
    extra_deletes: Iterable[str] = (),
    rules_in_table: int | None = None,
    edits: Mapping[str, tuple[Lines, Lines]] | None = None,
) -> str:
    """Write each chain of `changes` (None: delete it), plus the given jump rule edits.
    `rules_in_table` (the rules the table holds now; None: unknown) lets a script that names
    many chains list the table (`LIST_FIRST`) before its rules where that makes iptables-nft's
    restore cheaper. `edits`: chains changed rule by rule instead, (rules to delete, rules to
    append): not declared, so not flushed (`rule_edits`)."""
    edits = edits or {}
    deletes = {chain for chain, rules in changes.items() if rules is None} | set(extra_deletes)
    writes = {
        chain: rules for chain, rules in changes.items() if rules is not None and chain not in edits
    }
    lines = [f"*{table}"]
    named = writes.keys() | deletes
    listed = rules_in_table is not None and lists_first(
        len(named), len(named) + len(jump_edits) + sum(map(len, writes.values())), rules_in_table
    )
    # Listed: the chains the jump edits name, the edits, the listing, the rest (LIST_FIRST).
    first = {word for edit in jump_edits for word in edit.split()} & named if listed else named
    lines += [f":{chain} - [0:0]" for chain in sorted(first)]
    lines += jump_edits
    if listed:
        lines.append(LIST_FIRST)
        lines += [f":{chain} - [0:0]" for chain in sorted(named - first)]
    for chain in sorted(writes):
        lines += [f"-A {chain} {rule}" for rule in writes[chain]]
    for chain, (gone, added) in sorted(edits.items()):
        lines += [f"-D {chain} {rule}" for rule in gone]
        lines += [f"-A {chain} {rule}" for rule in added]
    lines += [f"-X {chain}" for chain in sorted(deletes)]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def streamed_table_script(
    table: str,
    head: Collection[str],
    ports: Iterable[Mapping[str, Lines]],
    tail: Callable[[], tuple[Mapping[str, Lines], Iterable[str]]],
    jump_edits: Sequence[str] = (),
    listed: bool = False,
) -> Iterator[str]:
    """A full sync's script of one table in pieces, in the order a restore can read them
    while the later ones are still being made (`kernel.Kernel.restore_pieces`): the `head`
    chains (those known before any service port is rendered: the fixed and shared chains)
    declared, the jump edits and the listing placed as `table_script` places them; then each
    port's own chains of this table as `ports` renders them, declared before their rules (a
    port's chains jump to one another, and legacy iptables-restore resolves a jump target as
    it reads the line); then, once every port is in, `tail()`'s rules for the head chains (the
    shared ones are composed of every port's part), and the chains it deletes, emptied then
    deleted. The same lines as `table_script` writes for these chains, in another order."""
    first = {word for edit in jump_edits for word in edit.split()} & set(head) if listed else head
    lines = [f"*{table}", *(f":{chain} - [0:0]" for chain in sorted(first)), *jump_edits]
    if listed:
        lines.append(LIST_FIRST)
        lines += [f":{chain} - [0:0]" for chain in sorted(set(head) - set(first))]
    yield "\n".join(lines) + "\n"
    for own in ports:
        if own:
            yield "".join(
                [
                    *(f":{chain} - [0:0]\n" for chain in own),
                    *(f"-A {chain} {rule}\n" for chain, rules in own.items() for rule in rules),
                ]
            )
    chains, deletes = tail()
    lines = [f"-A {chain} {rule}" for chain in sorted(head) for rule in chains[chain]]
    # A chain is deleted once nothing jumps to it (every chain of ours was rewritten by now)
    # and emptied (declared: a chain with rules cannot be deleted, EBUSY).
    lines += [f":{chain} - [0:0]" for chain in sorted(deletes)]
    lines += [f"-X {chain}" for chain in sorted(deletes)]
    lines.append("COMMIT")
    yield "\n".join(lines) + "\n"


@dataclass
class SavedTable:
    """What a full sync or cleanup needs from `iptables-save -t TABLE`."""

    builtin: set[str] = field(default_factory=set)  # built-in chains (they have a policy)
    ours: set[str] = field(default_factory=set)  # KPX- chains
    jumps: list[tuple[str, str]] = field(default_factory=list)  # (built-in chain, rule body)
    rules: int = 0  # every rule in the table, ours or not


def _has_our_comment(body: str) -> bool:
    try:
        words = shlex.split(body)
    except ValueError:
        words = body.split()
    return any(w == "--comment" and nxt == n.COMMENT for w, nxt in itertools.pairwise(words))


def parse_save(text: str) -> dict[str, SavedTable]:
    """Per table: the built-in chains, our chains, and our (`kpx`-commented) rules in the
    built-in chains. Everything else in the output is ignored."""
    tables: dict[str, SavedTable] = {}
    current: SavedTable | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:].strip(), SavedTable())
        elif current is None:
            continue
        elif line.startswith(":"):
            parts = line[1:].split()
            if len(parts) >= 2:
                if parts[1] != "-":
                    current.builtin.add(parts[0])
                elif n.is_ours(parts[0]):
                    current.ours.add(parts[0])
        elif line.startswith("-A "):
            current.rules += 1
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] in current.builtin and _has_our_comment(parts[2]):
                current.jumps.append((parts[1], parts[2]))
    return tables


@dataclass
class SavedChains:
    """Our chains' rules (chain -> rule bodies, in order) and our jump rules (built-in chain
    -> bodies) in `iptables-save -t TABLE` output."""

    rules: dict[str, list[str]] = field(default_factory=dict)
    jumps: dict[str, list[str]] = field(default_factory=dict)

    def digest(self) -> bytes:
        """A digest of all of it (rules as iptables-save prints them)."""
        h = hashlib.sha256()
        for part in (self.rules, self.jumps):
            for chain in sorted(part):
                h.update(f"\0{chain}\0".encode())
                h.update("\n".join(part[chain]).encode())
        return h.digest()


def saved_chains(text: str, table: str) -> SavedChains:
    """Our chains and jump rules in `table`'s part of iptables-save output."""
    saved = SavedChains()
    builtin: set[str] = set()
    current = ""
    for line in text.splitlines():
        if line.startswith("*"):
            current = line[1:].strip()
        elif current != table:
            continue
        elif line.startswith(":"):
            parts = line[1:].split()
            if len(parts) >= 2 and parts[1] != "-":
                builtin.add(parts[0])
            elif parts and n.is_ours(parts[0]):
                saved.rules.setdefault(parts[0], [])
        elif line.startswith("-A "):
            parts = line.split(" ", 2)
            body = parts[2] if len(parts) == 3 else ""
            if n.is_ours(parts[1]):
                saved.rules.setdefault(parts[1], []).append(body)
            elif parts[1] in builtin and _has_our_comment(body):
                saved.jumps.setdefault(parts[1], []).append(body)
    return saved


def structure_drift(
    saved: SavedChains, table: str, chains: Mapping[str, Lines], wanted_jumps: Sequence[n.Jump]
) -> str:
    """How our chains in the kernel (`saved`) differ from the record in shape ("": they do
    not): a chain missing or not ours to have, a chain with more or fewer rules than we
    wrote, our jump rules not as we left them. (Our rules' text is ours, not iptables-save's
    spelling, so rules are counted here, not compared; a digest taken while the kernel held
    our last sync finds a rule changed in place.)"""
    for chain in sorted(chains.keys() - saved.rules.keys()):
        return f"chain {chain} is missing"
    for chain in sorted(saved.rules.keys() - chains.keys()):
        return f"chain {chain} is not ours to have"
    for chain, rules in sorted(chains.items()):
        if len(saved.rules[chain]) != len(rules):
            return (
                f"chain {chain} has {len(saved.rules[chain])} rules, not the {len(rules)} written"
            )
    wanted: dict[str, list[str]] = {}
    for t, chain, matches, target in wanted_jumps:
        if t == table:
            wanted.setdefault(chain, []).append(n.jump_rule(matches, target).text)
    for chain in sorted(wanted.keys() | saved.jumps.keys()):
        if wanted.get(chain, []) != saved.jumps.get(chain, []):
            return f"our jump rules in {chain} differ"
    return ""


def jump_edits(
    table: str, saved: SavedTable, wanted_jumps: Sequence[n.Jump] = n.JUMPS
) -> list[str]:
    """Edits that leave exactly our jump rules, in order, in each built-in chain: the wanted
    rules already there in order are kept and every other `kpx` rule (duplicates, older
    versions, chains we no longer hook) is deleted; where some are missing, the chain's `kpx`
    rules are all deleted and the wanted ones inserted first, in order."""
    wanted: dict[str, list[str]] = {}
    for t, chain, matches, target in wanted_jumps:
        if t == table:
            wanted.setdefault(chain, []).append(n.jump_rule(matches, target).text)
    have: dict[str, list[str]] = {}
    for chain, body in saved.jumps:
        have.setdefault(chain, []).append(body)
    edits: list[str] = []
    for chain in sorted(have.keys() | wanted.keys()):
        want, found = wanted.get(chain, []), have.get(chain, [])
        kept: list[str] = []  # the wanted rules found in order; anything else goes
        extra: list[str] = []
        for body in found:
            if len(kept) < len(want) and body == want[len(kept)]:
                kept.append(body)
            else:
                extra.append(body)
        if kept != want:  # some are missing: write them all again, in order
            extra = found
        edits += [f"-D {chain} {body}" for body in extra]
        if kept != want:
            edits += [f"-I {chain} {i} {body}" for i, body in enumerate(want, 1)]
    return edits


def cleanup_script(table: str, saved: SavedTable) -> str:
    """Remove our jump rules and every KPX- chain of `table` ('' when there is none)."""
    if not saved.ours and not saved.jumps:
        return ""
    edits = [f"-D {chain} {body}" for chain, body in saved.jumps]
    return table_script(table, dict.fromkeys(saved.ours), edits)
