"""The ipvs backend: IPVS virtual servers over netlink, changed by per-Service-port deltas.

The backend keeps its own record of what it programmed (one PortPlan per Service port), so a
sync that touches one Service port sends only that port's changes: virtual servers added,
changed (scheduler, affinity) or removed, real servers added or drained, dummy-interface
addresses and helper-set elements (reference counted: several ports share a cluster IP).

A removed real server is not deleted at once: its weight drops to 0 (no new connections) and it
leaves at a later sync once IPVS counts no connection on it (upstream's graceful termination);
UDP and SCTP real servers leave at once, as upstream.

Changes to virtual and real servers are queued and sent in batches (kernel.Ipvs.flush: many
requests per netlink round trip, one ack each); a failure names every object whose request the
kernel refused.

A full sync (first sync, node or settings change, after a failure) reconciles with the kernel:
it reads the virtual servers and bound addresses back and removes what is not wanted (virtual
servers inside spec.ipvs.excludeCIDRs are left alone), and swaps the helper table in one nft
transaction. IPVS has no transactions: a failed sync raises BackendError and the next sync is a
full one, which repairs whatever half of the failed one was applied.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable

from ...model.types import DataplaneSettings, IPNetwork, NodeInfo, NodeLocalState, ServicePortKey
from ..base import Backend, BackendError
from ..kernel.nft_transaction import Transaction
from . import kernel
from .model import (
    FIREWALL_ALLOW,
    Element,
    PortPlan,
    VirtualKey,
    VirtualServer,
    allowed_elements,
    excluded,
    plan_port,
)
from .ruleset import element_changes, full_sync

log = logging.getLogger(__name__)
FAMILIES = (4, 6)
GRACEFUL_PROTOCOLS = ("tcp",)


class IpvsBackend(Backend):
    mode = "ipvs"

    def __init__(
        self, settings: DataplaneSettings, node_kernel: kernel.Kernel | None = None
    ) -> None:
        self.settings = settings
        self._kernel: kernel.Kernel = node_kernel or kernel.NodeKernel()
        self._ipvs: kernel.VirtualServers | None = None
        self._plans: dict[ServicePortKey, PortPlan] = {}
        self._bound: Counter[tuple[int, str]] = Counter()
        self._elements: dict[str, Counter[Element]] = {}
        # The source ranges of each load-balancer address and port, by Service port.
        self._firewall: dict[Element, dict[ServicePortKey, tuple[IPNetwork, ...]]] = {}
        self._draining: dict[VirtualKey, set[tuple[str, int]]] = {}
        self._node: NodeInfo | None = None
        self._settings_synced: DataplaneSettings | None = None

    # ---- the Backend protocol -------------------------------------------------------------------

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        try:
            if (
                changed is None
                or self._node is None
                or state.node != self._node
                or self.settings != self._settings_synced
            ):
                self._full_sync(state)
            else:
                self._partial_sync(state, changed)
            assert self._ipvs is not None
            self._ipvs.flush()  # the queued changes, in batches; raises naming what failed
            self._finish_draining()
        except Exception as exc:
            self._node = None  # the next sync is a full one and repairs what was half applied
            if self._ipvs is not None:
                self._ipvs.discard()  # what this sync queued and did not send
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"ipvs sync failed: {exc}") from exc

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings

    def cleanup(self) -> None:
        cleanup(self.settings.ipvs.exclude_cidrs)
        self._plans.clear()
        self._bound.clear()
        self._elements.clear()
        self._firewall.clear()
        self._draining.clear()
        self._node = None

    # ---- full sync ------------------------------------------------------------------------------

    def _setup_node(self) -> None:
        options = self.settings.ipvs
        for name, value in (
            ("net.ipv4.vs.conntrack", 1),  # so that nft masquerades IPVS-forwarded packets
            ("net.ipv4.vs.expire_nodest_conn", 1),
            ("net.ipv4.vs.expire_quiescent_template", 1),
        ):
            self._kernel.write_sysctl(name, value)
        if options.strict_arp:
            self._kernel.write_sysctl("net.ipv4.conf.all.arp_ignore", 1)
            self._kernel.write_sysctl("net.ipv4.conf.all.arp_announce", 2)
        self._kernel.set_timeouts(options.tcp_timeout, options.tcp_fin_timeout, options.udp_timeout)
        self._kernel.ensure_dummy()

    def _full_sync(self, state: NodeLocalState) -> None:
        if self._ipvs is None:
            self._ipvs = self._kernel.ipvs()
        ipvs = self._ipvs
        self._setup_node()
        plans = {
            key: plan_port(port, state.node, self.settings) for key, port in state.services.items()
        }
        wanted: dict[VirtualKey, VirtualServer] = {}
        bound: Counter[tuple[int, str]] = Counter()
        elements: dict[str, Counter[Element]] = {}
        firewall: dict[Element, dict[ServicePortKey, tuple[IPNetwork, ...]]] = {}
        for owner, plan in plans.items():
            wanted.update(plan.virtual_servers)
            bound.update(plan.bound)
            for name, members in plan.elements.items():
                elements.setdefault(name, Counter()).update(members)
            for vip, ranges in plan.firewall.items():
                firewall.setdefault(vip, {})[owner] = ranges
        allowed = Counter(
            e for vip, by in firewall.items() for e in allowed_elements(vip, by.values())
        )
        if allowed:
            elements[FIREWALL_ALLOW] = allowed
        # Virtual servers: read what is there first (the changes are then sent in batches),
        # remove what is not wanted, then make every wanted one right.
        present = set(ipvs.services())
        haves = {key: ipvs.real_servers(key) for key in present & wanted.keys()}
        for key in present - wanted.keys():
            if not excluded(key.address, self.settings.ipvs.exclude_cidrs):
                ipvs.delete_service(key)
        self._draining = {}
        for key, vs in wanted.items():
            if key in present:
                ipvs.set_service(vs)
                have = haves[key]
                # What an earlier run left at weight 0 (draining, or this backend's record
                # lost with a restart) drains on, or serves again if wanted.
                self._draining[key] = {s for s, real in have.items() if real.weight == 0}
                self._update_real_servers(vs, set(have), vs.real_servers)
            else:
                self._add_virtual_server(vs)
        # Addresses on the dummy interface.
        have_bound = self._kernel.bound_addresses()
        self._kernel.bind(
            [(True, f, a) for f, a in bound.keys() - have_bound]
            + [(False, f, a) for f, a in have_bound - bound.keys()]
        )
        # The helper table, swapped in one transaction per family.
        self._swap_helper_tables(state, elements)
        self._plans, self._bound, self._elements = plans, bound, elements
        self._firewall = firewall
        self._node = state.node
        self._settings_synced = self.settings

    # ---- partial sync ---------------------------------------------------------------------------

    def _partial_sync(self, state: NodeLocalState, changed: Collection[ServicePortKey]) -> None:
        ipvs = self._ipvs
        assert ipvs is not None
        empty = PortPlan()
        bind: list[tuple[bool, int, str]] = []
        adds: dict[str, set[Element]] = {}
        deletes: dict[str, set[Element]] = {}
        allowed_before: dict[Element, set[Element]] = {}
        olds = {key: self._plans.get(key, empty) for key in changed}
        news = {}
        for key in changed:
            port = state.services.get(key)
            news[key] = plan_port(port, state.node, self.settings) if port else empty
        # Virtual servers across all the changed ports at once: one that moves from one port to
        # another in this sync (the model gave a clashing VIP to another Service) is updated,
        # not deleted after (or added before) the other port's change.
        old_vs = {k: vs for plan in olds.values() for k, vs in plan.virtual_servers.items()}
        new_vs = {k: vs for plan in news.values() for k, vs in plan.virtual_servers.items()}
        for vkey in old_vs.keys() - new_vs.keys():
            ipvs.delete_service(vkey)
            self._draining.pop(vkey, None)
        for vkey, vs in new_vs.items():
            before = old_vs.get(vkey)
            if before is None:
                self._add_virtual_server(vs)
                continue
            if (before.scheduler, before.persistence) != (vs.scheduler, vs.persistence):
                ipvs.set_service(vs)
            if before.real_servers != vs.real_servers:
                self._update_real_servers(vs, set(before.real_servers), vs.real_servers)
        for key in changed:
            old, new, port = olds[key], news[key], state.services.get(key)
            for address in old.bound - new.bound:
                self._bound[address] -= 1
                if self._bound[address] <= 0:
                    del self._bound[address]
                    bind.append((False, *address))
            for address in new.bound - old.bound:
                if not self._bound[address]:
                    bind.append((True, *address))
                self._bound[address] += 1
            for name in old.elements.keys() | new.elements.keys():
                book = self._elements.setdefault(name, Counter())
                before_set, after_set = old.elements.get(name, set()), new.elements.get(name, set())
                for element in before_set - after_set:
                    book[element] -= 1
                    if book[element] <= 0:
                        del book[element]
                        deletes.setdefault(name, set()).add(element)
                for element in after_set - before_set:
                    if not book[element]:
                        adds.setdefault(name, set()).add(element)
                    book[element] += 1
            for vip in old.firewall.keys() | new.firewall.keys():
                owners = self._firewall.setdefault(vip, {})
                if vip not in allowed_before:
                    allowed_before[vip] = allowed_elements(vip, owners.values())
                owners.pop(key, None)
                if vip in new.firewall:
                    owners[key] = new.firewall[vip]
                elif not owners:
                    del self._firewall[vip]
            if port:
                self._plans[key] = new
            else:
                self._plans.pop(key, None)
        for vip, was in allowed_before.items():
            now = allowed_elements(vip, self._firewall.get(vip, {}).values())
            if was - now:
                deletes.setdefault(FIREWALL_ALLOW, set()).update(was - now)
            if now - was:
                adds.setdefault(FIREWALL_ALLOW, set()).update(now - was)
        if bind:
            self._kernel.bind(bind)
        changes = {family: element_changes(family, deletes, adds) for family in FAMILIES}
        self._run_per_family([txn for txn in changes.values() if txn])

    def _swap_helper_tables(
        self, state: NodeLocalState, elements: dict[str, Counter[Element]]
    ) -> None:
        """Each family's helper table, swapped in place where it is in the kernel and can be
        listed (`ruleset.full_sync`); where the kernel refuses that, replaced whole."""
        refused: list[str] = []
        for family in FAMILIES:
            facts = state.facts[family]
            contents = self._kernel.table_contents(family)
            try:
                try:
                    self._kernel.run_nft(full_sync(self.settings, facts, elements, contents))
                except kernel.KernelError as exc:
                    if contents is None:
                        raise
                    log.warning(
                        "IPv%d helper table: cannot swap its contents in place (%s); "
                        "replacing it whole",
                        family,
                        exc,
                    )
                    self._kernel.run_nft(full_sync(self.settings, facts, elements))
            except kernel.KernelError as exc:
                refused.append(f"IPv{family} helper table: {exc}")
        if refused:
            raise BackendError("; ".join(refused))

    def _run_per_family(self, transactions: Iterable[Transaction]) -> None:
        """Each family's helper-table transaction, one nft transaction each: a family the
        kernel refuses does not stop the other's; then BackendError names what was refused."""
        refused: list[str] = []
        for txn in transactions:
            try:
                self._kernel.run_nft(txn)
            except kernel.KernelError as exc:
                refused.append(f"IPv{txn.family} helper table: {exc}")
        if refused:
            raise BackendError("; ".join(refused))

    # ---- virtual and real servers ---------------------------------------------------------------

    def _add_virtual_server(self, vs: VirtualServer) -> None:
        assert self._ipvs is not None
        self._ipvs.add_service(vs)
        for address, port in sorted(vs.real_servers):
            self._ipvs.set_dest(vs.key, address, port, 1, new=True)

    def _update_real_servers(
        self, vs: VirtualServer, have: set[tuple[str, int]], want: Iterable[tuple[str, int]]
    ) -> None:
        assert self._ipvs is not None
        want = set(want)
        draining = self._draining.setdefault(vs.key, set())
        for address, port in sorted(want - have - draining):
            self._ipvs.set_dest(vs.key, address, port, 1, new=True)
        for address, port in sorted(want & draining):  # back before it drained: serve again
            self._ipvs.set_dest(vs.key, address, port, 1, new=False)
            draining.discard((address, port))
        for address, port in sorted(have - want - draining):
            if vs.key.protocol in GRACEFUL_PROTOCOLS:
                self._ipvs.set_dest(vs.key, address, port, 0, new=False)
                draining.add((address, port))
            else:
                self._ipvs.delete_dest(vs.key, address, port)
        if not draining:
            self._draining.pop(vs.key, None)

    def _finish_draining(self) -> None:
        """Delete the weight-0 real servers IPVS counts no connection on any more."""
        if not self._draining or self._ipvs is None:
            return
        for vkey in list(self._draining):
            have = self._ipvs.real_servers(vkey)
            servers = self._draining[vkey]
            for server in sorted(servers):
                if server not in have or have[server].connections == 0:
                    if server in have:
                        self._ipvs.delete_dest(vkey, *server)
                    servers.discard(server)
            if not servers:
                del self._draining[vkey]
        self._ipvs.flush()

    def draining(self) -> dict[VirtualKey, set[tuple[str, int]]]:
        """The real servers waiting for their connections to end (weight 0)."""
        return {k: set(v) for k, v in self._draining.items()}


def cleanup(exclude_cidrs: Iterable[object] = ()) -> None:
    """Remove every IPVS virtual server (but those in excludeCIDRs), the dummy interface and
    the helper table. Also what another mode's agent runs at start."""
    networks = tuple(exclude_cidrs)
    try:
        ipvs = kernel.Ipvs()
    except kernel.KernelError:
        ipvs = None  # no IPVS in this kernel: no virtual server can be left
    if ipvs is not None:
        try:
            for key in list(ipvs.services()):
                if not excluded(key.address, networks):  # type: ignore[arg-type]
                    ipvs.delete_service(key)
            ipvs.flush()
        finally:
            ipvs.close()
    kernel.delete_dummy()
    kernel.delete_tables()
