"""A Service the kernel refuses is left out, reported, and the rest is programmed: the proxier
narrows a refused sync down to the Services that cause it (bisection over the backend's check
mode), against the nftables kernel fake taught to refuse an element."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from backend_samples import SETTINGS

from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.backends.kernel.nft_transaction import Transaction
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.model.service_problems import REFUSED_BY_KERNEL
from kpx_agent.model.types import IP, Protocol
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import DATAPLANE, Proxier
from kpx_api.proxysettings import NamespaceOptOut

TCP = Protocol.TCP
POISON = IP.of("10.96.0.66")
POISON6 = IP.of("fd00:96::66")


def service(name: str, *cluster_ips: str) -> dict[str, Any]:
    families = ["IPv6" if ":" in ip else "IPv4" for ip in cluster_ips]
    return {
        "metadata": {"namespace": "d", "name": name},
        "spec": {
            "clusterIPs": list(cluster_ips),
            "ipFamilies": families,
            "ports": [{"port": 80, "protocol": "TCP"}],
        },
    }


class WatchedKernel(FakeNftables):
    """The fake, noting what the kernel held at each check the proxier's search made."""

    def __init__(self) -> None:
        super().__init__()
        self.held_at_checks: list[str] = []

    def check_transactions(self, transactions: Iterable[Transaction]) -> str | None:
        self.held_at_checks.append(self.dump())
        return super().check_transactions(transactions)


def setup() -> tuple[ClusterState, WatchedKernel, Proxier]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    fake = WatchedKernel()
    fake.refuse = {POISON, POISON6}
    backend = NftablesBackend(SETTINGS, fake)
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    proxier.delete_flows = lambda filters: 0
    return state, fake, proxier


def cluster_ips(fake: FakeNftables, family: int = 4) -> set[str]:
    return {str(key[0]) for key in fake.elements(family, n.CLUSTER_IPS)}


def refused(proxier: Proxier) -> set[str]:
    found = proxier.problems.of(DATAPLANE)
    assert all(p.reason == REFUSED_BY_KERNEL and "refused (EINVAL)" in p.message for p in found)
    return {p.name for p in found}


def test_a_refused_service_in_a_partial_sync_is_left_out_and_the_rest_programmed() -> None:
    state, fake, proxier = setup()
    state.upsert(SERVICES, service("a", "10.96.0.10"))
    assert proxier.sync().ok
    before = fake.dump()
    state.upsert(SERVICES, service("poison", str(POISON)))
    state.upsert(SERVICES, service("b", "10.96.0.11"))
    assert proxier.sync().ok
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.11"}
    assert refused(proxier) == {"poison"}
    # The search changed nothing in the kernel: every check found it as before the sync.
    assert fake.held_at_checks and set(fake.held_at_checks) == {before}
    # Later changes reach the kernel; the culprit stays out without being searched again.
    transactions = fake.transactions
    state.upsert(SERVICES, service("c", "10.96.0.12"))
    assert proxier.sync().ok and fake.transactions == transactions + 1
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.11", "10.96.0.12"}
    assert refused(proxier) == {"poison"}
    # Fixed, it is tried again and programmed; the problem goes away.
    state.upsert(SERVICES, service("poison", "10.96.0.13"))
    assert proxier.sync().ok
    assert "10.96.0.13" in cluster_ips(fake) and refused(proxier) == set()


def test_a_full_sync_with_a_refused_service_programs_the_others() -> None:
    state, fake, proxier = setup()
    for name, ip in (("a", "10.96.0.10"), ("poison", str(POISON)), ("z", "10.96.0.19")):
        state.upsert(SERVICES, service(name, ip))
    outcome = proxier.sync()
    assert outcome.ok and outcome.full
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.19"} and refused(proxier) == {"poison"}
    # A later full sync tries it again (still refused: left out again).
    proxier.request_full_sync("test")
    assert proxier.sync().ok and refused(proxier) == {"poison"}
    fake.refuse = set()  # the kernel accepts it now (a newer kernel, another module)
    proxier.request_full_sync("test")
    assert proxier.sync().ok and refused(proxier) == set()
    assert str(POISON) in cluster_ips(fake)


def test_an_ipv6_only_fault_does_not_stop_ipv4_even_of_the_same_service() -> None:
    state, fake, proxier = setup()
    state.upsert(SERVICES, service("a", "10.96.0.10"))
    assert proxier.sync().ok
    state.upsert(SERVICES, service("dual", "10.96.0.20", str(POISON6)))
    state.upsert(SERVICES, service("b", "10.96.0.11"))
    assert proxier.sync().ok
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.11", "10.96.0.20"}
    assert cluster_ips(fake, 6) == set()
    assert refused(proxier) == {"dual"}
    (problem,) = proxier.problems.of(DATAPLANE)
    assert problem.message.startswith("IPv6 not programmed")


def test_a_fault_no_service_causes_is_a_failed_sync_as_before() -> None:
    state, fake, proxier = setup()
    state.upsert(SERVICES, service("a", "10.96.0.10"))
    assert proxier.sync().ok
    fake.refuse = {TCP}  # every service element: nothing can be left out to fix it
    state.upsert(SERVICES, service("b", "10.96.0.11"))
    outcome = proxier.sync()
    assert not outcome.ok and refused(proxier) == set()
    assert cluster_ips(fake) == {"10.96.0.10"}  # the last good rules stay


def test_a_family_the_kernel_refuses_whole_does_not_stop_the_other() -> None:
    """A fault in the IPv6 table no Service causes (say, a kernel without IPv6 NAT): the
    sync fails and is retried, but IPv4's changes are in the kernel, in full and partial
    syncs."""
    state, fake, proxier = setup()
    state.upsert(SERVICES, service("a", "10.96.0.10", "fd00:96::10"))
    assert proxier.sync().ok
    fake.broken_families = {6}
    state.upsert(SERVICES, service("b", "10.96.0.11", "fd00:96::11"))
    outcome = proxier.sync()
    assert not outcome.ok and not outcome.full and "IPv6" in outcome.error
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.11"}
    assert cluster_ips(fake, 6) == {"fd00:96::10"}  # the last good IPv6 rules stay
    state.upsert(SERVICES, service("c", "10.96.0.12", "fd00:96::12"))
    outcome = proxier.sync()
    assert not outcome.ok and outcome.full and refused(proxier) == set()
    assert cluster_ips(fake) == {"10.96.0.10", "10.96.0.11", "10.96.0.12"}
    fake.broken_families = set()
    assert proxier.sync().ok
    assert cluster_ips(fake, 6) == {"fd00:96::10", "fd00:96::11", "fd00:96::12"}


def iptables_setup() -> tuple[ClusterState, FakeIptables, Proxier]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    fake = FakeIptables()
    backend = IptablesBackend(
        SETTINGS,
        fake,
        ensure_sysctl=lambda path, value: None,
    )
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    proxier.delete_flows = lambda filters: 0
    return state, fake, proxier


def saved(fake: FakeIptables, family: int) -> str:
    return fake.save(family, "nat") + fake.save(family, "filter")


def test_iptables_mode_leaves_out_a_service_iptables_restore_refuses() -> None:
    state, fake, proxier = iptables_setup()
    fake.refuse = {str(POISON)}
    state.upsert(SERVICES, service("a", "10.96.0.10"))
    assert proxier.sync().ok
    state.upsert(SERVICES, service("poison", str(POISON)))
    state.upsert(SERVICES, service("b", "10.96.0.11"))
    assert proxier.sync().ok
    rules = saved(fake, 4)
    assert "10.96.0.10" in rules and "10.96.0.11" in rules and str(POISON) not in rules
    assert refused(proxier) == {"poison"}


def test_iptables_mode_a_family_refused_whole_does_not_stop_the_other() -> None:
    state, fake, proxier = iptables_setup()
    state.upsert(SERVICES, service("a", "10.96.0.10", "fd00:96::10"))
    assert proxier.sync().ok
    fake.broken_families = {6}
    state.upsert(SERVICES, service("b", "10.96.0.11", "fd00:96::11"))
    outcome = proxier.sync()
    assert not outcome.ok and not outcome.full and "IPv6" in outcome.error
    assert "10.96.0.11" in saved(fake, 4) and "fd00:96::11" not in saved(fake, 6)
    state.upsert(SERVICES, service("c", "10.96.0.12", "fd00:96::12"))
    outcome = proxier.sync()
    assert not outcome.ok and outcome.full
    assert "10.96.0.12" in saved(fake, 4) and "fd00:96::10" in saved(fake, 6)
    fake.broken_families = set()
    assert proxier.sync().ok and "fd00:96::12" in saved(fake, 6)
