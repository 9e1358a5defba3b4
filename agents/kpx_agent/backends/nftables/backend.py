"""The nftables backend: one table per IP family, changed by element deltas.

Each family's table is changed by its own nft transaction: one the kernel refuses leaves that
family's last good rules in place and the other family's change applied (the sync still fails,
and the next one is a full one).

A full sync swaps each table atomically (used at start, which takes over a previous agent's
rules without a gap, after a failure, and when the node or settings change). Every other sync
sends only the elements that changed, computed against the backend's own record, so it never
reads the kernel's ruleset back.

When a family's table is not in the kernel (a node's first start, a flushed ruleset), its full
sync takes two steps: nft creates the table with empty sets and maps (matching nothing, so it
changes no traffic), then netlink batches add the elements, with about a tenth of nft's CPU,
the dispatch maps last (a Service starts to be served once all it dispatches to is there).
Where the table exists, the swap stays one nft transaction, elements included, so the old
rules serve until the new ones are complete. It swaps the table's contents in place
(`in_place`): the backend lists the table (chains, the comment of each rule, sets and maps,
over netlink, no elements), and the transaction empties every set and map, flushes every
chain, defines the new contents over them and deletes at its end what they lack; the
endpoint chains holding exactly this version's rule are kept as they are. A set or map
created in a transaction misses lookups around the commit (interval sets, endpoint maps), so
deleting and creating the table dropped new flows at each swap. Where the table cannot be
listed, or the kernel refuses the swap in place (a kept set declared otherwise now), the
table is deleted and defined again in one transaction.

Drift (`drifted`, asked at every syncPeriod): the kernel's ruleset generation id moves with
every committed nftables transaction, anyone's. The backend reads it before and after each of
its own syncs; unchanged since its last commit means nothing at all changed (one netlink
request). When another writer committed (iptables-nft, a CNI plugin, someone with `nft`), the
backend compares a digest of its own tables (`netlink_query`: sets, rules, elements; not the
dynamic affinity sets) with the digest it took while the kernel held exactly its last commit:
equal, the other writer's change was elsewhere; different, or no such digest since its last
sync (it and another writer both committed since the last check), a full sync rewrites
everything. That digest is taken at a check that found the generation unchanged since the
backend's last commit (one dump of its tables per syncPeriod in which it committed). The dump
(`read_kernel`) runs while syncs go on, and its digests count only for the generation id they
were read at: a commit since (ours or anyone's) leaves the judgement to the next check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...model.types import DataplaneSettings, NodeLocalState, ServicePort, ServicePortKey
from ..base import Backend, BackendError, KernelReadBack
from ..kernel.nft_query import Overtaken
from ..kernel.nft_transaction import RedefineTable, TableContents, TableDef, Transaction
from ..route_localnet import ROUTE_LOCALNET_FILE, EnsureSysctl, allow, ensure_sysctl
from . import kernel, netlink_batch
from . import names as n
from .element_book import ElementBook, Plan
from .in_place import defined_names, in_place, leftovers
from .ruleset import (
    MERGED_SETS,
    ChainDef,
    PortRender,
    base_table,
    endpoint_chain,
    endpoint_chain_counts,
    endpoint_rule,
    is_endpoint_map,
    iter_kernel_pairs,
    kernel_count,
    kernel_pairs,
    kernel_size,
    render_port,
)
from .schema import Element, Pair

log = logging.getLogger(__name__)
FAMILIES = (4, 6)
# Service ports rendered per part of a streamed full sync: small enough that nft starts
# parsing early, large enough that a part is one `add element` per set.
STREAM_CHUNK = 1000


@dataclass(frozen=True)
class TableDigests(KernelReadBack):
    """What the drift check read ahead (`NftablesBackend.read_kernel`)."""

    gen: int | None  # the ruleset generation id the digests are of
    digests: dict[int, bytes] | None = None  # per family; None: not read (or not settled)


class NftablesBackend(Backend):
    mode = "nftables"

    def __init__(
        self,
        settings: DataplaneSettings,
        node_kernel: kernel.Kernel | None = None,
        ensure_sysctl: EnsureSysctl = ensure_sysctl,
        route_localnet_file: Path = ROUTE_LOCALNET_FILE,
    ) -> None:
        """`node_kernel`: every nftables edge (`kernel.NodeKernel` when None; the fake,
        `fake.FakeNftables`, receives the same typed transactions); `ensure_sysctl` and
        `route_localnet_file`: the route_localnet edge of localhost NodePorts."""
        self.settings = settings
        self._ensure_sysctl = ensure_sysctl
        self._route_localnet_file = route_localnet_file
        self._kernel: kernel.Kernel = node_kernel or kernel.NodeKernel()
        self._books: dict[int, ElementBook[ServicePortKey]] = {
            f: ElementBook(MERGED_SETS, kernel_count) for f in FAMILIES
        }
        self._chains: dict[int, set[tuple[str, int]]] = {f: set() for f in FAMILIES}
        self._port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]] = {
            f: {} for f in FAMILIES
        }
        # False until a full sync succeeded, and after a failure: what the kernel holds is
        # not known, so a sync is full whatever it was asked (the proxier asks for one then).
        self._synced = False
        self._last_sent: list[Transaction] = []
        # How many elements the last full sync loaded by netlink, per family it loaded (for
        # logs and tests; the elements themselves are not kept: 100,000+ at 10,000 Services).
        self.last_loaded: dict[int, int] = {}
        # Drift (see the module docstring): the generation id after our last commit (None:
        # unknown), whether another writer committed since, and the digest of our tables taken
        # while they held exactly our last commit (None: none since that commit).
        self._gen: int | None = None
        self._foreign = False
        self._baseline: dict[int, bytes] | None = None

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings

    def programmed(self) -> bool:
        """True while the kernel still has our tables (someone may flush the ruleset)."""
        if not self._synced:
            return False
        try:
            return self._kernel.present_families() == set(FAMILIES)
        except BackendError as exc:
            log.warning("cannot ask the kernel for our tables: %s", exc)
            return False

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        self._last_sent = []
        full = changed is None or not self._synced
        before = self._read_generation()
        if before is None or before != self._gen:
            self._foreign = True  # someone committed since our last commit (or unknown)
        if changed is None or not self._synced:
            self._full_sync(state)
        else:
            self._partial_sync(state, changed)
        after = self._read_generation()
        if after is None or after != before:  # we committed: the digest is of the past
            self._baseline = None
        self._gen = after
        if full:
            self._foreign = False  # everything we own was just rewritten

    # -- drift

    def _read_generation(self) -> int | None:
        try:
            return self._kernel.generation()
        except (OSError, ValueError) as exc:
            log.debug("cannot read the ruleset generation: %s", exc)
            return None

    def _digests(self, gen: int) -> dict[int, bytes] | None:
        """Our tables' digests, read while the ruleset is of generation `gen` (None: a commit
        overtook the read, which then stops at once, or the tables cannot be read)."""

        def still() -> bool:
            return self._read_generation() == gen

        try:
            digests = {f: self._kernel.table_digest(f, still) for f in FAMILIES}
        except Overtaken:
            return None
        except (OSError, ValueError) as exc:
            log.warning("cannot read our tables back for the drift check: %s", exc)
            return None
        return digests if still() else None

    def read_kernel(self) -> TableDigests | None:
        """The digests of our tables where the check will want them (a dump of each table: 0.75
        s at 10,000 Services), with the generation id they are of: runs while syncs go on,
        and `drifted` uses them only if nothing committed since (None: never synced)."""
        if not self._synced:
            return None
        gen = self._read_generation()
        if gen is None:
            return TableDigests(None)
        if gen == self._gen and not self._foreign:
            wanted = self._baseline is None  # the digest of exactly our last commit
        else:
            wanted = self._baseline is not None  # (without one, a full sync is due anyway)
        if not wanted:
            return TableDigests(gen)
        started = time.monotonic()
        digests = self._digests(gen)
        log.debug(
            "drift check: our tables read back in %.3f s%s",
            time.monotonic() - started,
            "" if digests is not None else " (overtaken by a commit, or unreadable: not used)",
        )
        if digests is None:
            return TableDigests(gen)  # a commit during the read: of no generation
        return TableDigests(gen, digests)

    def drifted(self, reading: KernelReadBack | None = None) -> str:
        """Why our tables may differ from our last commit ("": they do not), with the digests
        `reading` holds (`read_kernel`; None: read them now, if needed); see the module
        docstring. Between syncs."""
        if not self._synced:
            return ""  # the next sync is a full one anyway
        gen = self._read_generation()
        if gen is None:
            return ""  # the kernel cannot be asked; a sync would say more

        def digests() -> dict[int, bytes] | None:
            """Our tables' digests of generation `gen` (None: not to be had now)."""
            if reading is None:
                return self._digests(gen)
            if isinstance(reading, TableDigests) and reading.gen == gen:
                return reading.digests  # nothing committed since it was read
            return None  # the next check reads again

        if gen == self._gen and not self._foreign:
            if self._baseline is None:
                self._baseline = digests()
            return ""
        if self._baseline is None:
            return "another writer committed to nftables since our last change"
        now = digests()
        if now is None:
            return ""
        changed = [n.FAMILIES[f] for f in FAMILIES if now[f] != self._baseline[f]]
        if changed:
            return f"our {' and '.join(changed)} table changed behind our back"
        # Another writer's commit, elsewhere: the tables are still ours as we left them.
        self._gen, self._foreign = gen, False
        return ""

    def _full_sync(self, state: NodeLocalState) -> None:
        if self.settings.localhost_node_ports:
            # nftables.localhostNodePorts: route_localnet=1, so that NodePorts DNATed from
            # 127.0.0.0/8 may leave the node (the input and output hooks drop the martians it
            # lets in). Without it they do not answer: logged, the rest is programmed.
            allow(self._route_localnet_file, "nftables.localhostNodePorts", self._ensure_sysctl)
        plans: dict[int, Plan[ServicePortKey]] = {f: Plan(merge=MERGED_SETS) for f in FAMILIES}
        chains: dict[int, set[tuple[str, int]]] = {f: set() for f in FAMILIES}
        port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]] = {
            f: {} for f in FAMILIES
        }
        # Families without a table in the kernel get their bulk elements by netlink.
        present = self._kernel.present_families()
        loaded: dict[int, dict[str, list[Pair]]] = {f: {} for f in FAMILIES if f not in present}
        self.last_loaded = {}
        by_family = self._by_family(state)
        refused: list[str] = []
        for fam in FAMILIES:
            # Each family is its own transaction: one the kernel refuses leaves the other's in.
            t0 = time.monotonic()
            contents = self._kernel.table_contents(fam) if fam in present else None
            try:
                try:
                    self._apply(
                        self._family_script(
                            fam, state, by_family[fam], plans, chains, port_chains, loaded, contents
                        )
                    )
                except BackendError as exc:
                    if contents is None:
                        raise
                    # Refused in place (a kept set declared otherwise now, someone else's
                    # object in the way): the table is replaced whole, as the first swap did.
                    log.warning(
                        "%s %s: cannot swap its contents in place (%s); replacing it whole",
                        n.FAMILIES[fam],
                        n.TABLE,
                        exc,
                    )
                    plans[fam], chains[fam], port_chains[fam] = Plan(merge=MERGED_SETS), set(), {}
                    self._apply(
                        self._family_script(
                            fam, state, by_family[fam], plans, chains, port_chains, loaded, None
                        )
                    )
                log.debug("full sync: IPv%d's nft part in %.3f s", fam, time.monotonic() - t0)
                self._load_family(fam, loaded)
            except BackendError as exc:
                refused.append(f"IPv{fam}: {exc}")
                continue
            book: ElementBook[ServicePortKey] = ElementBook(MERGED_SETS, kernel_count)
            book.commit(plans[fam])
            self._log_conflicts(plans[fam])
            self._books[fam], self._chains[fam] = book, chains[fam]
            self._port_chains[fam] = port_chains[fam]
        # A family refused keeps its last good rules; the next sync swaps both again.
        self._synced = not refused
        if refused:
            raise BackendError("; ".join(refused))

    def _load_family(self, fam: int, loaded: dict[int, dict[str, list[Pair]]]) -> None:
        """The netlink part of a family's full sync (none where its table was there)."""
        if fam not in loaded:
            return
        started = time.monotonic()
        sets = loaded[fam]
        self._kernel.load_elements(
            {fam: {name: iter_kernel_pairs(name, pairs) for name, pairs in sets.items()}}
        )
        self.last_loaded[fam] = sum(kernel_size(name, pairs) for name, pairs in sets.items())
        log.info(
            "%s %s: no table in the kernel: %d elements loaded by netlink (%.3f s)",
            n.FAMILIES[fam],
            n.TABLE,
            self.last_loaded[fam],
            time.monotonic() - started,
        )

    @staticmethod
    def _by_family(state: NodeLocalState) -> dict[int, list[ServicePort]]:
        by_family: dict[int, list[ServicePort]] = {f: [] for f in FAMILIES}
        for key, sp in state.services.items():
            by_family[key.family].append(sp)
        return by_family

    def _full_script(
        self,
        state: NodeLocalState,
        plans: dict[int, Plan[ServicePortKey]],
        chains: dict[int, set[tuple[str, int]]],
        port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]],
        loaded: dict[int, dict[str, list[Pair]]],
    ) -> Iterator[Transaction]:
        """Both families' full sync transactions, one after the other (`check` asks about
        them together)."""
        by_family = self._by_family(state)
        for fam in FAMILIES:
            yield from self._family_script(
                fam, state, by_family[fam], plans, chains, port_chains, loaded
            )

    def _family_script(
        self,
        fam: int,
        state: NodeLocalState,
        ports: list[ServicePort],
        plans: dict[int, Plan[ServicePortKey]],
        chains: dict[int, set[tuple[str, int]]],
        port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]],
        loaded: dict[int, dict[str, list[Pair]]],
        contents: TableContents | None = None,
    ) -> Iterator[Transaction]:
        """A family's full sync transaction, one part per chunk of service ports, rendered as
        nft reads it (and filling in the plans and chains it programs, and for the families
        in `loaded`, the elements left out of it for the netlink load). With the `contents`
        of the table in the kernel, the table's contents are swapped in place (`in_place`),
        what the new contents lack deleted at the end; without, the table is replaced whole."""
        table = base_table(self.settings, state.facts[fam])
        if contents is None:
            yield from self._parts(fam, ports, plans, chains, port_chains, loaded, table, None)
            return
        redefine = in_place(table, contents, lambda name: endpoint_rule(fam, name))
        defined: set[str] = set()
        for txn in self._parts(fam, ports, plans, chains, port_chains, loaded, table, redefine):
            defined |= defined_names(txn)
            yield txn
        # the endpoint chains (and maps) in use, the kept ones among them
        defined |= {n.endpoint_chain_of(dispatch, count) for dispatch, count in chains[fam]}
        txn = leftovers(fam, contents, redefine, defined)
        if txn:
            yield txn

    def _parts(
        self,
        fam: int,
        ports: list[ServicePort],
        plans: dict[int, Plan[ServicePortKey]],
        chains: dict[int, set[tuple[str, int]]],
        port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]],
        loaded: dict[int, dict[str, list[Pair]]],
        table: TableDef,
        redefine: RedefineTable | None,
    ) -> Iterator[Transaction]:
        """The parts of `_family_script`: the table (replaced whole, or `redefine`d in
        place), then the service ports by chunks, then the merged elements."""
        txn = Transaction(fam, n.TABLE)
        if redefine is None:
            txn.replace_table(table)
        else:
            txn.redefine_table(redefine)
        kept = redefine.kept if redefine is not None else frozenset()
        yield txn
        for start in range(0, len(ports), STREAM_CHUNK):
            txn = Transaction(fam, n.TABLE)
            claimed: list[Element] = []
            for sp in ports[start : start + STREAM_CHUNK]:
                render = render_port(sp)
                if render.chains:
                    port_chains[fam][sp.key] = render.chains
                    for name, chain in render.chains.items():
                        txn.add_port_chain(name, chain.sets, chain.rules)
                claimed += plans[fam].claim_fresh(sp.key, render.elements)
            new_chains = endpoint_chain_counts(claimed) - chains[fam]
            chains[fam] |= new_chains
            for dispatch_map, count in sorted(new_chains):
                name, endpoint_map, dnat = endpoint_chain(fam, dispatch_map, count)
                if name not in kept:  # (a kept one is in the kernel, its map emptied)
                    txn.add_endpoint_chain(name, endpoint_map, dnat)
            by_set: dict[str, list[Pair]] = {}
            for set_name, element_key, value in claimed:
                pairs = by_set.get(set_name)
                if pairs is None:
                    pairs = by_set[set_name] = []
                pairs.append((element_key, value))
            bulk = loaded.get(fam)
            for set_name, pairs in sorted(by_set.items()):
                if bulk is not None and netlink_batch.loadable(set_name):
                    # the record's pairs: `_load_family` makes the kernel's as it sends them
                    bulk.setdefault(set_name, []).extend(pairs)
                else:
                    txn.add_elements(set_name, kernel_pairs(set_name, pairs))
            yield txn
        # What several Services share (merged across owners), once all have claimed.
        txn = Transaction(fam, n.TABLE)
        merged: dict[str, list[Pair]] = {}
        for set_name, element_key, value in plans[fam].merged_elements():
            merged.setdefault(set_name, []).append((element_key, value))
        for set_name, pairs in sorted(merged.items()):
            txn.add_elements(set_name, kernel_pairs(set_name, pairs))
        if txn:
            yield txn

    def check(self, state: NodeLocalState) -> str | None:
        """Whether the kernel accepts `state` as both tables, swapped whole (the full sync's
        transaction, every element in nft text), asked in nft's check mode: nothing changes,
        and this backend's record neither."""
        plans: dict[int, Plan[ServicePortKey]] = {f: Plan(merge=MERGED_SETS) for f in FAMILIES}
        chains: dict[int, set[tuple[str, int]]] = {f: set() for f in FAMILIES}
        port_chains: dict[int, dict[ServicePortKey, dict[str, ChainDef]]] = {
            f: {} for f in FAMILIES
        }
        transactions = self._full_script(state, plans, chains, port_chains, {})
        return self._kernel.check(transactions)

    def _partial_sync(self, state: NodeLocalState, changed: Collection[ServicePortKey]) -> None:
        plans: dict[int, Plan[ServicePortKey]] = {}
        chain_updates: dict[int, dict[ServicePortKey, dict[str, ChainDef]]] = {}
        new_chains: dict[int, set[tuple[str, int]]] = {}
        script: list[Transaction] = []
        for fam in FAMILIES:
            renders: dict[ServicePortKey, PortRender | None] = {}
            for key in changed:
                if key.family == fam:
                    sp = state.services.get(key)
                    renders[key] = render_port(sp) if sp is not None else None
            if not renders:
                continue
            plan = self._books[fam].plan(
                {k: (r.elements if r is not None else None) for k, r in renders.items()}
            )
            added = [(s, k, v) for s, pairs in plan.add.items() for k, v in pairs]
            new_chains[fam] = endpoint_chain_counts(added) - self._chains[fam]
            pre, post = Transaction(fam, n.TABLE), Transaction(fam, n.TABLE)
            owned = self._port_chains[fam]
            chain_updates[fam] = {}
            for key, render in renders.items():
                new = render.chains if render is not None else {}
                old = owned.get(key, {})
                if new != old:
                    self._diff_port_chains(pre, post, old, new)
                    chain_updates[fam][key] = new
            if not plan and not pre and not post:
                continue
            self._render(pre, fam, new_chains[fam], plan)
            plans[fam] = plan
            pre.ops += post.ops
            script.append(pre)
        refused: list[str] = []
        for txn in script:
            # Each family is its own transaction: one the kernel refuses leaves the other's in.
            try:
                self._apply([txn])
            except BackendError as exc:
                refused.append(f"IPv{txn.family}: {exc}")
                del plans[txn.family]
        for fam, plan in plans.items():
            self._books[fam].commit(plan)
            self._chains[fam] |= new_chains[fam]
            self._log_conflicts(plan)
            for key, new in chain_updates.get(fam, {}).items():
                if new:
                    self._port_chains[fam][key] = new
                else:
                    self._port_chains[fam].pop(key, None)
        if refused:
            raise BackendError("; ".join(refused))  # and the next sync is a full one

    @staticmethod
    def _diff_port_chains(
        pre: Transaction,
        post: Transaction,
        old: dict[str, ChainDef],
        new: dict[str, ChainDef],
    ) -> None:
        """Create or rewrite chains before the elements that jump to them change; delete
        chains no longer used after, then the sets none of the port's chains uses any more.
        A port's chains share their sets (an endpoint's affinity set), and a set the port
        still uses is kept with its elements when a chain using it is renamed."""
        have = {decl.name for chain in old.values() for decl in chain.sets}
        for name, chain in new.items():
            if old.get(name) != chain:
                fresh = [decl for decl in chain.sets if decl.name not in have]
                have.update(decl.name for decl in fresh)
                pre.add_port_chain(name, fresh, chain.rules)
        for name in old:
            if name not in new:
                post.delete_chain(name)
        used = {decl.name for chain in new.values() for decl in chain.sets}
        for name in dict.fromkeys(decl.name for chain in old.values() for decl in chain.sets):
            if name not in used:
                post.delete_set(name)

    @staticmethod
    def _render(
        txn: Transaction, fam: int, chains: set[tuple[str, int]], plan: Plan[ServicePortKey]
    ) -> None:
        for dispatch_map, count in sorted(chains):
            txn.add_endpoint_chain(*endpoint_chain(fam, dispatch_map, count))
        adds: dict[str, list[Pair]] = {}
        for set_name in sorted(plan.delete.keys() | plan.add.keys()):
            replaced = [(k, plan.replaced[(set_name, k)]) for k in plan.delete.get(set_name, ())]
            old = kernel_pairs(set_name, replaced)
            new = kernel_pairs(set_name, plan.add.get(set_name, ()))
            if set_name in MERGED_SETS or is_endpoint_map(set_name):
                # A value replaced: only the kernel elements it changes (one endpoint of a
                # run; one range of an allow list).
                old_set, new_set = set(old), set(new)
                old = [p for p in old if p not in new_set]
                new = [p for p in new if p not in old_set]
            txn.delete_elements(set_name, [key for key, _ in old])
            adds[set_name] = new
        for set_name, pairs in adds.items():
            txn.add_elements(set_name, pairs)

    def _apply(self, transactions: Iterable[Transaction]) -> None:
        # What was sent, for logs and tests: the transactions, as they went to the kernel.
        sent = self._last_sent
        try:

            def recorded() -> Iterator[Transaction]:
                for txn in transactions:
                    sent.append(txn)
                    yield txn

            self._kernel.run(recorded())
        except BackendError:
            # The kernel kept the last good rules; our record still equals them, but force a
            # full swap next time in case the kernel state drifted (it is the safe recovery).
            self._synced = False
            raise

    @property
    def last_script(self) -> str:
        """The text of the last transaction sent (for logs and tests)."""
        return "".join(txn.render() for txn in self._last_sent)

    @staticmethod
    def _log_conflicts(plan: Plan[ServicePortKey]) -> None:
        for (set_name, key), owner in plan.conflicts:
            log.warning("%s: %s %s is already claimed by another Service", owner, set_name, key)

    def element_count(self) -> int:
        """The elements of our sets and maps: the record's, an endpoint run counted as its
        endpoints (as the kernel holds them)."""
        return sum(b.kernel_size() for b in self._books.values())

    def cleanup(self) -> None:
        cleanup()


def cleanup() -> None:
    """Remove every table this backend made. A table of its name that carries `flags owner`
    stays: it belongs to a running process (the kernel refuses anyone else's change to it and
    removes it when that process's socket closes), and this backend never makes one."""
    tables = kernel.our_tables()
    try:
        kernel.delete_tables(tables)
    except BackendError:
        owned = {t for t in tables if kernel.owned_by_a_process(t)}
        if not owned:
            raise
        log.warning(
            "left table %s: owned by a running process, not this backend's",
            ", ".join(sorted(owned)),
        )
        kernel.delete_tables(tables - owned)


__all__ = ["FAMILIES", "BackendError", "NftablesBackend", "cleanup", "n"]
