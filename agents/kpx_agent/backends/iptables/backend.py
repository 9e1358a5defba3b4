"""The iptables backend: KPX- chains in the nat and filter tables, changed chain by chain.

A full sync (start, after a failure, node or settings change) reads which KPX- chains and jump
rules exist (`iptables-save -t nat|filter`), then rewrites every chain of ours, deletes the
KPX- chains it no longer wants and leaves exactly one jump rule in each built-in chain. Every
other sync rewrites only the chains whose content changed, computed against the backend's own
record (`chain_book.py`), so it never reads the kernel back. Other software's chains and rules
are never named in a script, so `--noflush` leaves them alone. KPX-HAIRPIN (a rule per local
endpoint address, in no particular order: `script.ORDER_FREE`) is edited rule by rule (`-D`,
`-A`) where that is shorter; a `-D` of a rule someone removed fails the restore, and the next
sync is a full one.

Each (family, table) is its own `*-restore` run, atomic on its own. If a later run of a
partial sync fails, the runs of that family before it are reverted from the record; the other
family's change still goes in (one family's fault does not stop the other's programming), and
the next sync is a full one in any case.

Drift (`drifted`, asked at every syncPeriod): `iptables-save` of each table, and our chains
and jump rules in it compared with the record: every chain there and no other of ours, each
with as many rules as written (iptables-save spells rules its own way, so they are counted,
not compared), our jump rules as written. A digest of them is taken at the first check after
each sync, and a later check that finds another one finds a rule changed in place. A deleted
rule, a flushed or deleted chain, a rule another process added to one of ours, a jump rule
gone, a rule replaced: the agent's next sync is a full one, which rewrites them all. (A rule
replaced in place before the digest is taken is found by the hourly full sync only.)
With iptables-nft, every table a restore changes is one nftables transaction: while the
ruleset's generation id (`backends.nf_generation`) has not moved since the chains were last
verified, the check reads nothing back (reading back costs seconds at 10,000 Services and 15 s
at 30,000: docs/benchmarks.md). Nor does it after syncs whose transactions account for every
step the generation moved (`commits_of`: nobody else committed since the chains were verified,
so the kernel holds what the record says). The digest that finds a rule changed in place is
then taken at the first check that finds no commit since the one before (a quiet syncPeriod),
so a node under constant change reads nothing back until another writer commits.
The read-back (`read_kernel`) runs while syncs go on: each sync notes the chains it rewrites
while a read is under way (`_note`), and the comparison leaves those out (the kernel may have
shown them before or after the sync); no digest is taken or compared across a sync, and a read
that a full sync overlapped finds nothing (the full sync rewrote everything anyway).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...model.types import DataplaneSettings, NodeLocalState, ServicePortKey
from ..base import Backend, BackendError, KernelReadBack
from ..route_localnet import allow
from . import kernel
from . import names as n
from .chain_book import ChainBook, ChainPlan
from .rules import Lines, PortLines, fixed_chains, port_rules, shared_frames
from .script import (
    ORDER_FREE,
    SavedChains,
    SavedTable,
    cleanup_script,
    jump_edits,
    lists_first,
    parse_save,
    rule_edits,
    saved_chains,
    streamed_table_script,
    structure_drift,
    table_script,
)

log = logging.getLogger(__name__)
FAMILIES = (4, 6)

EnsureSysctl = Callable[[Path, int], None]  # (sysctl file, value)
#: What a sync rewrote in one family: (table, chain names), or (None, ()) for everything (a
#: full sync: every chain and the jump rules).
Touch = tuple[int, str | None, frozenset[str]]


@dataclass(frozen=True)
class SavedTables(KernelReadBack):
    """What the drift check read from the kernel (`IptablesBackend.read_kernel`)."""

    gen: int | None  # the ruleset generation id before the read
    # Our chains per (family, table) as iptables-save showed them; None: nothing needed
    # reading (only our own commits since the chains were verified).
    saved: dict[tuple[int, str], SavedChains] | None = None
    error: str = ""  # the read failed: why (the check finds nothing, the next one reads again)


class IptablesBackend(Backend):
    mode = "iptables"

    def __init__(
        self,
        settings: DataplaneSettings,
        node_kernel: kernel.Kernel | None = None,
        ensure_sysctl: EnsureSysctl = kernel.ensure_sysctl,
        route_localnet_file: Path = kernel.ROUTE_LOCALNET_FILE,
    ) -> None:
        """`node_kernel`: every iptables edge (`kernel.NodeKernel` when None; the fake,
        `fake.FakeIptables`, applies the same scripts); `ensure_sysctl` and
        `route_localnet_file`: the route_localnet edge of localhost NodePorts."""
        self.settings = settings
        self._kernel: kernel.Kernel = node_kernel or kernel.NodeKernel()
        self._ensure_sysctl = ensure_sysctl
        self._route_localnet_file = route_localnet_file
        # None: what the kernel holds is not known (never synced, or a sync failed).
        self._books: dict[int, ChainBook] | None = None
        # The jump rules each family's last full sync left in the built-in chains.
        self._jumps: dict[int, tuple[n.Jump, ...]] = {}
        # Digests of our chains per (family, table), taken at the first drift check after our
        # last sync (None: none since).
        self._baseline: dict[tuple[int, str], bytes] | None = None
        # The nftables ruleset generation id after our last sync or check (None: legacy
        # iptables, or not known): while it does not move, nothing changed.
        self._gen: int | None = None
        # Whether every commit since the chains were last read back and found as written was
        # one of our syncs' (iptables-nft): then the kernel holds what the record says.
        self._verified = False
        # The generation id the last drift check found (a quiet period: the same at the next).
        self._checked_gen: int | None = None
        # The nftables transactions the running sync's restores made (`commits_of`).
        self._commits = 0
        # What the running sync rewrote so far, and while a drift check reads the kernel,
        # what syncs rewrote since it began (None: no read under way); `_note`.
        self._touch_lock = threading.Lock()
        self._rewriting: list[Touch] = []
        self._touched: list[Touch] | None = None
        # The rules the last sync wrote per (family, table) (upstream's _last rule metric);
        # counted, not kept: a full sync's script is 16 MB at 10,000 Services.
        self.last_written: dict[tuple[int, str], int] = {}

    # -- the Backend protocol

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        before = self._kernel.generation()
        verified, self._verified = self._verified, False  # (a failed sync leaves it False)
        self._commits = 0
        try:
            if changed is None or self._books is None:
                self._full_sync(state)
            else:
                self._partial_sync(state, self._books, changed)
        finally:
            with self._touch_lock:
                self._rewriting = []
        after = self._kernel.generation()
        if after is None or after != before:  # we committed: the digest is of the past
            self._baseline = None
        # Only our transactions since the chains were verified: they still are.
        self._verified = (
            verified
            and before is not None
            and after is not None
            and before == self._gen
            and after - before == self._commits
        )
        self._gen = after

    def _note(self, touches: list[Touch]) -> None:
        """Before a restore: what it rewrites (for a drift check's read under way, and one
        that starts while this sync runs)."""
        with self._touch_lock:
            self._rewriting += touches
            if self._touched is not None:
                self._touched += touches

    def _restore(self, family: int, script: str) -> None:
        self._kernel.restore(family, script)
        self._commits += commits_of(script)

    def cleanup(self) -> None:
        cleanup(self._kernel)
        self._books = None

    # -- optional hooks the agent uses

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings

    def programmed(self) -> bool:
        """True while the kernel still has our chains (someone may flush the tables)."""
        if self._books is None:
            return False
        try:
            return all(self._kernel.chain_exists(fam, n.NAT, n.MARK_MASQ) for fam in FAMILIES)
        except BackendError:
            return False

    def read_kernel(self) -> SavedTables | None:
        """Our chains in the kernel, as `drifted` compares them (iptables-save of each table:
        seconds at 10,000 Services); nothing where the generation id says nothing but our own
        syncs committed since they were verified. Runs while syncs go on (see the module
        docstring); None: nothing was ever programmed."""
        if self._books is None:
            return None
        with self._touch_lock:  # from here on, what syncs rewrite is noted
            self._touched = list(self._rewriting)
        gen = self._kernel.generation()
        if gen is not None and gen == self._gen:
            if self._baseline is not None:
                return SavedTables(gen)  # no commit at all since the chains were verified
            if self._verified and gen != self._checked_gen:
                return SavedTables(gen)  # only ours since; the digest waits for a quiet check
        saved: dict[tuple[int, str], SavedChains] = {}
        for fam in FAMILIES:
            for table in n.TABLES:
                try:
                    saved[(fam, table)] = saved_chains(self._kernel.save(fam, table), table)
                except BackendError as exc:
                    return SavedTables(gen, error=str(exc))
        return SavedTables(gen, saved)

    def drifted(self, reading: KernelReadBack | None = None) -> str:
        """What of ours differs in the kernel from the record ("": nothing), from `reading`
        (`read_kernel`; None: read now); see the module docstring. Between syncs."""
        if reading is None:
            reading = self.read_kernel()
        with self._touch_lock:
            touched, self._touched = self._touched or [], None
        if self._books is None or not isinstance(reading, SavedTables):
            return ""  # the next sync is a full one anyway
        gen = self._checked_gen = reading.gen
        if reading.error:
            log.warning("drift check: %s", reading.error)
            return ""
        if reading.saved is None:
            return ""
        if any(table is None for _, table, _ in touched):
            return ""  # a full sync ran meanwhile: it rewrote everything
        skip: dict[tuple[int, str], set[str]] = {}
        for fam, table, names in touched:
            if table is not None:
                skip.setdefault((fam, table), set()).update(names)
        digests: dict[tuple[int, str], bytes] = {}
        for fam, book in self._books.items():
            for table in n.TABLES:
                saved = reading.saved[(fam, table)]
                chains = book.table_chains(table)
                left_out = skip.get((fam, table))
                if left_out:
                    chains = {c: r for c, r in chains.items() if c not in left_out}
                    saved = SavedChains(
                        {c: r for c, r in saved.rules.items() if c not in left_out}, saved.jumps
                    )
                why = structure_drift(saved, table, chains, self._jumps.get(fam, ()))
                if why:
                    return f"IPv{fam} {table}: {why}"
                digests[(fam, table)] = saved.digest()
        if touched:
            return ""  # a sync ran meanwhile: no digest of this read stands for the kernel's
        if self._baseline is None:
            self._baseline = digests
        for (fam, table), digest in sorted(digests.items()):
            if digest != self._baseline.get((fam, table)):
                return f"IPv{fam} {table}: a rule of ours was changed behind our back"
        if gen is not None and self._kernel.generation() == gen:  # nothing committed since
            self._gen = gen
            self._verified = True
        return ""

    def element_count(self) -> int:
        """Rules in our chains (the agent reports it as programmed elements)."""
        return sum(b.rule_count() for b in (self._books or {}).values())

    def chain_count(self) -> int:
        return sum(len(b) for b in (self._books or {}).values())

    def rule_counts(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Per (family, table): the rules in our chains, and the rules the last sync wrote
        (upstream's kubeproxy_sync_proxy_rules_iptables_total and _last)."""
        return {
            (fam, table): (
                sum(len(rules) for rules in book.table_chains(table).values()),
                self.last_written.get((fam, table), 0),
            )
            for fam, book in (self._books or {}).items()
            for table in n.TABLES
        }

    def packet_counts(self) -> dict[str, float]:
        """The packet counters of the IPv4 rules that stand for upstream's nfacct counters:
        conntrack-INVALID packets dropped (KPX-FORWARD), and packets to 127.0.0.0/8 sent to
        the NodePorts (KPX-SERVICES' localhost rule; 0 without localhost NodePorts)."""
        invalid = kernel.rule_packets(4, n.FILTER, n.FORWARD, ("DROP", "INVALID"))
        localhost = 0
        if self.settings.localhost_node_ports:
            localhost = kernel.rule_packets(4, n.NAT, n.SERVICES, (n.NODEPORTS, "127.0.0.0/8"))
        return {
            "kubeproxy_iptables_ct_state_invalid_dropped_packets_total": invalid,
            "kubeproxy_iptables_localhost_nodeports_accepted_packets_total": localhost,
        }

    # -- syncs

    def _full_sync(self, state: NodeLocalState) -> None:
        if self.settings.localhost_node_ports:
            self._allow_localhost_node_ports()
        self._books = None  # until every table is in
        self.last_written = {}
        self._note([(fam, None, frozenset()) for fam in FAMILIES])
        nf_tables = self._kernel.nf_tables()  # (script.LIST_FIRST pays off there only)
        books: dict[int, ChainBook] = {}
        refused: dict[int, str] = {}
        for fam in FAMILIES:
            book, tables = self._full_tables(state, fam, nf_tables)
            try:
                # One family's fault does not stop the other's programming.
                for table, pieces in tables:
                    # The first table's pieces render the service ports: iptables-nft reads
                    # them while the later ones are made. Legacy iptables-restore holds the
                    # xtables lock from a table's first line to its COMMIT: there the script
                    # is made whole first, so other tools wait no longer than the restore.
                    counted = _Counted(pieces)
                    self._kernel.restore_pieces(fam, counted if nf_tables else ["".join(counted)])
                    self._commits += 1  # (a full sync's table always declares chains)
                    self.last_written[(fam, table)] = counted.rules
            except BackendError as exc:
                refused[fam] = f"IPv{fam}: {exc}"
                continue
            books[fam] = book
        if refused:
            raise BackendError("; ".join(refused.values()))
        self._books = books

    def check(self, state: NodeLocalState) -> str | None:
        """Whether the kernel accepts `state` as a full sync's restore scripts, asked with
        `*-restore --test` (reads our tables' current chains, applies nothing)."""
        nf_tables = self._kernel.nf_tables()
        for fam in FAMILIES:
            for _, pieces in self._full_tables(state, fam, nf_tables)[1]:
                refused = self._kernel.check(fam, "".join(pieces))
                if refused is not None:
                    return f"IPv{fam}: {refused}"
        return None

    def _full_tables(
        self, state: NodeLocalState, fam: int, nf_tables: bool
    ) -> tuple[ChainBook, list[tuple[str, Iterable[str]]]]:
        """A family's full sync: its record, and each table's restore script in pieces, to
        be read in order. The first table's pieces (nat: where the service ports' own chains
        are) render the ports as they are read (`script.streamed_table_script`), each port's
        typed rules written out as soon as they are made (the record keeps the text); once
        every port is rendered the record takes them all, and the other tables' scripts are
        written from it."""
        settings = self.settings
        facts = state.facts[fam]
        book = ChainBook(fixed_chains(settings, facts), shared_frames(settings, facts))
        jumps = n.jumps(facts.localhost_node_ports)
        self._jumps[fam] = jumps
        saved = {
            table: parse_save(self._kernel.save(fam, table)).get(table, SavedTable())
            for table in n.TABLES
        }
        ports = [sp for key, sp in state.services.items() if key.family == fam]
        updates: dict[ServicePortKey, PortLines] = {}
        first, *others = n.TABLES

        def rendered() -> Iterator[dict[str, Lines]]:
            local = facts.local_pods
            for sp in ports:
                lines = updates[sp.key] = port_rules(sp, settings, local).lines()
                yield {chain: rules for (t, chain), rules in lines.own.items() if t == first}

        def tail() -> tuple[dict[str, Lines], set[str]]:
            book.commit(book.plan(updates))
            wanted = book.table_chains(first)
            return wanted, saved[first].ours - wanted.keys()

        head = book.table_chains(first).keys()
        edits = jump_edits(first, saved[first], jumps)
        # How many chains and lines the script will have, before it is rendered (its own
        # chains: about one per port, and a line per endpoint), for `lists_first`.
        chains = len(head) + len(ports)
        lines = chains + len(edits) + sum(2 + len(sp.cluster_endpoints) for sp in ports)
        listed = nf_tables and lists_first(chains, lines, saved[first].rules)
        tables: list[tuple[str, Iterable[str]]] = [
            (first, streamed_table_script(first, head, rendered(), tail, edits, listed))
        ]
        for table in others:
            script = functools.partial(self._table_script, book, saved, table, jumps)
            tables.append((table, _later(script)))
        return book, tables

    @staticmethod
    def _table_script(
        book: ChainBook, saved: dict[str, SavedTable], table: str, jumps: tuple[n.Jump, ...]
    ) -> str:
        """A full sync's script of a table after the first, from the record."""
        wanted = book.table_chains(table)
        return table_script(
            table,
            dict(wanted),
            jump_edits(table, saved[table], jumps),
            extra_deletes=saved[table].ours - wanted.keys(),
        )

    def _partial_sync(
        self,
        state: NodeLocalState,
        books: dict[int, ChainBook],
        changed: Collection[ServicePortKey],
    ) -> None:
        plans: dict[int, ChainPlan] = {}
        units: list[tuple[int, str, str, frozenset[str]]] = []  # (family, table, script, chains)
        for fam in FAMILIES:
            updates: dict[ServicePortKey, PortLines | None] = {}
            local = state.facts[fam].local_pods
            for key in changed:
                if key.family == fam:
                    sp = state.services.get(key)
                    updates[key] = (
                        port_rules(sp, self.settings, local).lines() if sp is not None else None
                    )
            if not updates:
                continue
            plan = books[fam].plan(updates)
            plans[fam] = plan
            for table in plan.tables():
                changes = plan.table_changes(table)
                by_rule = {}
                for chain in ORDER_FREE & changes.keys():
                    old, new = books[fam].chains.get((table, chain)), changes[chain]
                    if old is not None and new is not None and (edit := rule_edits(old, new)):
                        by_rule[chain] = edit
                script = table_script(table, changes, edits=by_rule)
                units.append((fam, table, script, frozenset(changes)))
        self.last_written = written_rules((fam, script) for fam, _, script, _ in units)
        refused: list[str] = []
        for fam in list(plans):
            # Each family on its own: a refused table reverts its family's tables before it,
            # and the other family's change still goes in.
            done: list[tuple[int, str]] = []
            for f, table, script, chains in units:
                if f != fam:
                    continue
                self._note([(fam, table, chains)])
                try:
                    self._restore(fam, script)
                except BackendError as exc:
                    self._revert(books, {fam: plans.pop(fam)}, done)
                    refused.append(f"IPv{fam}: {exc}")
                    break
                done.append((fam, table))
        for fam, plan in plans.items():
            books[fam].commit(plan)
        if refused:
            self._books = None  # the next sync is a full one
            raise BackendError("; ".join(refused))

    def _allow_localhost_node_ports(self) -> None:
        """route_localnet=1 in this network namespace, so that NodePorts DNATed from
        127.0.0.0/8 may leave the node (upstream sets it likewise; KPX-LOCALNET drops the
        martians it would let in). Without it, localhost NodePorts do not answer: logged,
        and the rest of the rules are still programmed."""
        allow(self._route_localnet_file, "iptables.localhostNodePorts", self._ensure_sysctl)

    def _revert(
        self,
        books: dict[int, ChainBook],
        plans: dict[int, ChainPlan],
        done: list[tuple[int, str]],
    ) -> None:
        """Undo the tables a failed partial sync already changed; the next sync is full."""
        self._books = None
        for fam, table in reversed(done):
            undo = books[fam].revert(plans[fam], table)
            self._note([(fam, table, frozenset(undo))])
            try:
                self._restore(fam, table_script(table, undo))
            except BackendError as exc:
                log.error("could not revert %s table of IPv%d: %s", table, fam, exc)


def written_rules(units: Iterable[tuple[int, str]]) -> dict[tuple[int, str], int]:
    """The rules (`-A` and `-I` lines) of restore scripts, per (family, table section): by
    string counts in place, not lines (a full sync's script is tens of MB)."""
    written: dict[tuple[int, str], int] = {}
    for fam, script in units:
        starts = [0] if script.startswith("*") else []
        at = script.find("\n*")
        while at != -1:
            starts.append(at + 1)
            at = script.find("\n*", at + 1)
        ends = [*starts[1:], len(script)] if starts else []
        for start, end in zip(starts, ends, strict=True):
            eol = script.find("\n", start, end)
            table = script[start + 1 : eol if eol != -1 else end].strip()
            rules = script.count("\n-A ", start, end) + script.count("\n-I ", start, end)
            written[(fam, table)] = written.get((fam, table), 0) + rules
    return written


def _later(script: Callable[[], str]) -> Iterator[str]:
    """A script made only when it is read (after the tables before it)."""
    yield script()


class _Counted:
    """Restore pieces passed through, counting the rules (`-A`, `-I` lines) in them (each
    piece is whole lines)."""

    def __init__(self, pieces: Iterable[str]) -> None:
        self._pieces = pieces
        self.rules = 0

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self.rules += (
                piece.count("\n-A ") + piece.count("\n-I ") + piece.startswith(("-A ", "-I "))
            )
            yield piece


def commits_of(script: str) -> int:
    """The nftables transactions iptables-nft makes of a restore script: one per table section
    that changes anything (measured with iptables-nft 1.8.9: a section with no line between its
    `*table` and `COMMIT` commits nothing). Only `*table` lines start with `*`, and string
    searches keep this cheap on a full sync's tens of MB (a line-anchored regex took 0.4 s on
    46 MB)."""
    text = script if script.endswith("\n") else script + "\n"
    commits = text.count("\nCOMMIT\n") + text.startswith("COMMIT\n")
    headers = [0] if text.startswith("*") else []
    at = text.find("\n*")
    while at != -1:
        headers.append(at + 1)
        at = text.find("\n*", at + 1)
    empty = sum(text.startswith("COMMIT\n", text.find("\n", h) + 1) for h in headers)
    return commits - empty


def cleanup(node_kernel: kernel.Kernel | None = None) -> None:
    """Remove our jump rules and every KPX- chain, in both families and both tables."""
    tools = node_kernel or kernel.NodeKernel()
    for fam in FAMILIES:
        if node_kernel is None and not kernel.available(fam):
            continue  # no iptables tools for this family: nothing of ours can be there
        for table in n.TABLES:
            saved = parse_save(tools.save(fam, table)).get(table)
            script = cleanup_script(table, saved) if saved is not None else ""
            if script:
                tools.restore(fam, script)


__all__ = ["FAMILIES", "BackendError", "IptablesBackend", "cleanup"]
