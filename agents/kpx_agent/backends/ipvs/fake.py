"""The ipvs backend's kernel, faked (as knftables ships `Fake`): for the unit tests, and for
anyone who embeds the backend without a kernel. `FakeKernel` is a `kernel.Kernel`: IPVS's
virtual and real servers (`FakeIpvs`, with connection counts a test sets), the addresses on
the dummy interface, and the helper table's transactions, received as the same typed
`Transaction` objects the real kernel renders for nft."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..kernel.nft_transaction import Transaction
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
        return {d: RealServer(w, self.conns.get((key, d), 0))
                for d, w in self.dests[key].items()}  # fmt: skip


class FakeKernel:
    """Every kernel edge of the ipvs backend (`kernel.Kernel`), in memory. `refuse_nft`, when
    set, is asked about each helper-table transaction: a reason refuses it (KernelError)."""

    def __init__(self, ipvs: FakeIpvs | None = None) -> None:
        self.fake_ipvs = ipvs or FakeIpvs()
        self.bound: set[tuple[int, str]] = set()  # (family, address) on the dummy interface
        self.nft: list[Transaction] = []  # helper-table transactions applied, in order
        self.sysctls: dict[str, int] = {}
        self.timeouts: tuple[int, int, int] = (0, 0, 0)
        self.refuse_nft: Callable[[Transaction], str | None] | None = None

    def ipvs(self) -> FakeIpvs:
        return self.fake_ipvs

    def write_sysctl(self, name: str, value: int) -> bool:
        self.sysctls[name] = value
        return True

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
        self.nft.append(transaction)

    def scripts(self) -> list[str]:
        """The nft text of each applied transaction (what the real kernel would have run)."""
        return [txn.render() for txn in self.nft]
