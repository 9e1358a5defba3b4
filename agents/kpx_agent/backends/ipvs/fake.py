"""The ipvs backend's kernel, faked (as knftables ships `Fake`): for the unit tests, and for
anyone who embeds the backend without a kernel. `FakeKernel` is a `kernel.Kernel`: IPVS's
virtual and real servers (`FakeIpvs`, with connection counts a test sets), the addresses on
the dummy interface, and the helper table, built from the same typed `Transaction` objects
the real kernel renders for nft (applied and checked by the kernel toolkit's nftables fake,
`kernel.nft_fake`).

`FakeKernel.trace(packet)` walks a packet through what the backend programmed, as the kernel
does in ipvs mode: the helper table's chains at each hook (marks in nat prerouting and
output, drops in filter input and output, masquerade in nat postrouting); an address bound on
the dummy interface is the node's, so a packet to a virtual server's address is delivered
(input). IPVS takes it at LOCAL_IN (priority 98), or at LOCAL_OUT (-99) for what the node
sends, between that hook's chains of lower and higher priority (a chain after it never sees
a packet IPVS took); it picks one real server of weight above 0 (each one, over the walk's
choices) and sends the packet on to it through postrouting; a virtual server with no such
real server answers ICMP port unreachable (upstream's ip_vs_leave: a reject). A packet to a
port with no virtual server is left alone."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from ..kernel.nft_fake import FakeError, FakeTable, NftWalk, apply, check_rules, contents_of
from ..kernel.nft_transaction import TableContents, Transaction
from ..kernel.packet_walk import Outcome, Packet, every_outcome
from .kernel import KernelError, RealServer
from .model import VirtualKey, VirtualServer


class FakeIpvs:
    """IPVS's table: each change applied at once (nothing is queued), every call recorded."""

    def __init__(self) -> None:
        self.virtual_servers: dict[VirtualKey, VirtualServer] = {}
        self.dests: dict[VirtualKey, dict[tuple[str, int], int]] = {}
        self.conns: dict[tuple[VirtualKey, tuple[str, int]], int] = {}
        self.calls: list[tuple[str, ...]] = []

    def add_service(self, vs: VirtualServer) -> None:
        self.calls.append(("add_service", vs.key.address, str(vs.key.port)))
        self.virtual_servers[vs.key] = vs
        self.dests[vs.key] = {}

    def set_service(self, vs: VirtualServer) -> None:
        self.calls.append(("set_service", vs.key.address, str(vs.key.port)))
        self.virtual_servers[vs.key] = vs

    def delete_service(self, key: VirtualKey) -> None:
        self.calls.append(("delete_service", key.address, str(key.port)))
        del self.virtual_servers[key]
        del self.dests[key]

    def set_dest(self, key: VirtualKey, address: str, port: int, weight: int, new: bool) -> None:
        self.calls.append(("set_dest", key.address, address, str(weight)))
        assert ((address, port) in self.dests[key]) is not new
        self.dests[key][(address, port)] = weight

    def delete_dest(self, key: VirtualKey, address: str, port: int) -> None:
        self.calls.append(("delete_dest", key.address, address))
        del self.dests[key][(address, port)]

    def flush(self) -> None:
        """Each change was applied at once: nothing is queued."""

    def discard(self) -> None:
        self.calls.append(("discard",))

    def services(self) -> list[VirtualKey]:
        return list(self.virtual_servers)

    def real_servers(self, key: VirtualKey) -> dict[tuple[str, int], RealServer]:
        return {d: RealServer(w, self.conns.get((key, d), 0)) for d, w in self.dests[key].items()}


class FakeKernel:
    """Every kernel edge of the ipvs backend (`kernel.Kernel`), in memory. `refuse_nft`, when
    set, is asked about each helper-table transaction: a reason refuses it (KernelError)."""

    def __init__(self, ipvs: FakeIpvs | None = None) -> None:
        self.fake_ipvs = ipvs or FakeIpvs()
        self.bound: set[tuple[int, str]] = set()  # (family, address) on the dummy interface
        self.nft: list[Transaction] = []  # helper-table transactions applied, in order
        self.tables: dict[int, FakeTable] = {}  # the helper table of each family
        self.sysctls: dict[str, int] = {}
        self.timeouts: tuple[int, int, int] = (0, 0, 0)
        self.refuse_nft: Callable[[Transaction], str | None] | None = None
        #: set: every write_sysctl fails with this message (a read-only /proc/sys)
        self.refuse_sysctl: str | None = None
        #: families whose helper table cannot be listed (a full sync then replaces it whole)
        self.unlistable: set[int] = set()

    def ipvs(self) -> FakeIpvs:
        return self.fake_ipvs

    def write_sysctl(self, name: str, value: int) -> None:
        if self.refuse_sysctl is not None:
            raise KernelError(self.refuse_sysctl)
        self.sysctls[name] = value

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        self.timeouts = (tcp, tcp_fin, udp)

    def ensure_dummy(self) -> int:
        return 1

    def bound_addresses(self) -> set[tuple[int, str]]:
        return set(self.bound)

    def bind(self, address_changes: Iterable[tuple[bool, int, str]]) -> None:
        for add, family, address in address_changes:
            (self.bound.add if add else self.bound.discard)((family, address))

    def run_nft(self, transaction: Transaction) -> None:
        reason = self.refuse_nft(transaction) if self.refuse_nft else None
        if reason:
            raise KernelError(f"nft: {reason}")
        staged = copy.deepcopy(self.tables)
        try:
            for op in transaction.ops:
                apply(staged, transaction.family, op, transaction.table)
            for table in staged.values():
                check_rules(table)
        except FakeError as exc:
            raise KernelError(f"nft: {exc}") from exc
        self.tables = staged
        self.nft.append(transaction)

    def table_contents(self, family: int) -> TableContents | None:
        table = self.tables.get(family)
        if table is None or family in self.unlistable:
            return None
        return contents_of(table)

    def scripts(self) -> list[str]:
        """The nft text of each applied transaction (what the real kernel would have run)."""
        return [txn.render() for txn in self.nft]

    def trace(self, packet: Packet) -> set[Outcome]:
        """Every outcome of `packet` over all random choices (the real server IPVS picks)."""
        table = self.tables.get(packet.family)
        return every_outcome(lambda choices: _IpvsWalk(self, table, packet, choices))


#: Where IPVS takes packets, by hook: LOCAL_IN at NF_IP_PRI_NAT_SRC - 2 (ip_vs_reply4 and
#: ip_vs_remote_request4), LOCAL_OUT at NF_IP_PRI_NAT_DST + 1 (ip_vs_local_request4).
IPVS_PRIORITY = {"input": 98, "output": -99}


class _IpvsWalk(NftWalk):
    """The helper table's chains at each hook, then IPVS at input and output."""

    def __init__(
        self, kernel: FakeKernel, table: FakeTable | None, packet: Packet, choices: list[int]
    ) -> None:
        super().__init__(table, packet, choices)
        self.kernel = kernel

    def is_local(self, address: str) -> bool:
        """The node's addresses and those bound on the dummy interface."""
        bound = (self.packet.family, address) in self.kernel.bound
        return bound or super().is_local(address)

    def hook(self, hook: str) -> str:
        priority = IPVS_PRIORITY.get(hook)
        if priority is None or self.sent_on:
            return self.nft_hook(hook)
        verdict = self.nft_hook(hook, below=priority)
        if verdict != "accept":
            return verdict
        taken = self.ipvs()
        if taken is not None:
            return taken  # IPVS stole the packet: later chains of this hook never see it
        return self.nft_hook(hook, from_=priority)

    def ipvs(self) -> str | None:
        """IPVS at this hook: None when no virtual server matches (the packet goes on)."""
        ipvs = self.kernel.fake_ipvs
        key = VirtualKey(self.packet.family, self.packet.protocol.value, self.daddr, self.dport)
        if key not in ipvs.virtual_servers:
            return None
        serving = sorted(d for d, weight in ipvs.dests[key].items() if weight > 0)
        if not serving:
            return "reject"  # ip_vs_leave: ICMP port unreachable, the packet dropped
        address, port = serving[self.choose(len(serving))]
        self.redirect(address, port)
        self.sent_on = True
        return "accept"
