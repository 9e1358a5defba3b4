"""Stale conntrack entries, shared by every mode.

UDP has no connection teardown: when an endpoint goes away, clients keep sending into the
conntrack entry that still DNATs to it; when a Service goes from no endpoints to some, the
entries created while it was rejected or unrouted keep being used. Both blackhole the client
until the entry expires (the long-standing upstream bug class). After each successful sync the
agent deletes exactly those entries.

"Created while rejected or unrouted" are the entries that were not DNATed: their reply comes
from the address the client sent to (a ClusterIP, external or load-balancer IP), or from the
NodePort itself. An entry DNATed to a serving endpoint is a live flow and stays, as upstream
kube-proxy keeps it (pkg/proxy/conntrack/cleanup.go deletes only entries whose reply source is
not a serving endpoint). This matters on every agent start (a mode switch, an upgrade, a
restart): there every UDP port goes from "nothing known" to its endpoints, and deleting every
entry to its addresses dropped the replies of exchanges in flight (issue #18's load measured
one lost exchange in 4,300 on a mode switch). An entry DNATed to an endpoint that went away
while no agent ran on the node is deleted when the port is first programmed
(`reconcile_flows`: those DNATed to an address that is not one of the port's serving
endpoints; upstream finds them by listing the whole table at every sync).

TCP and SCTP entries are torn down by their protocols, with one exception: an entry to a
ClusterIP made while the node had no rule for it (before its Service was programmed, or while a
foreign change had removed the rule, until the agent repaired it) was never DNATed. The packet
went on to the ClusterIP itself, nobody answered, and the entry stays in SYN_SENT for
nf_conntrack_tcp_timeout_syn_sent (2 min). A new connection whose source port the client picks
again within that time follows that entry instead of the rule: it is not DNATed and fails
(`make chaos` measured 13 of 2,112 new connections failing in the 2 minutes after a deleted
element was repaired). So when a port gets endpoints (a new Service included), and for every
port after a sync that repaired the kernel's rules, the entries to its ClusterIPs that were not
DNATed are deleted, whatever the protocol. A ClusterIP belongs to no host: an entry to it that
was not DNATed is never a live flow. (External and load-balancer IPs and NodePorts may be a
node's own addresses, where a TCP flow that is not DNATed can be live: for TCP and SCTP only
ClusterIPs are cleaned.)

`stale_flows` and `FlowFilter.matches` are pure; `delete_flows` is the I/O edge: over netlink
(conntrack_wire's messages), as upstream kube-proxy does (vishvananda/netlink), one dump of
the table per IP family and one deletion per entry a filter matches. conntrack_cleaner runs it
off the programming path.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import socket
import time
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..model.types import IPAddress, Protocol, ServicePort
from . import wire
from .wire import NETLINK_NETFILTER, PROTO_SCTP, PROTO_TCP, PROTO_UDP, Entry, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class FlowFilter:
    """Delete entries of protocol `proto` (UDP unless said) to `dst` (or to any address, for a
    NodePort) on `port`: only those
    DNATed to `dnat_to` (and, when `dnat_port` is set, to that port of it: the same pod with
    another targetPort is another endpoint, as upstream tells them apart), or with `not_nated`
    only those that were not DNATed (the reply comes from `dst` itself; for a NodePort, from
    `port` itself)."""

    family: int
    port: int
    dst: IPAddress | None = None
    dnat_to: str | None = None
    not_nated: bool = False
    dnat_port: int = 0
    proto: int = PROTO_UDP
    #: Only those DNATed to an address not in this set (the port's serving endpoints): what an
    #: agent's start reconciles (`reconcile_flows`).
    keep: frozenset[str] | None = None
    #: Not the entries to these addresses (a NodePort's filter, which has no `dst`: the
    #: addresses of other UDP Service ports on the same port number, whose entries are theirs).
    skip_dsts: frozenset[str] = frozenset()

    def matches(self, entry: Entry) -> bool:
        """Whether `entry` is one this filter deletes: what `conntrack -D -p udp` matched
        with the options this filter stood for (-p, --orig-dst, --orig-port-dst; --dst-nat and
        --reply-port-src; --reply-src, or --reply-port-src for a NodePort)."""
        orig, reply = entry.orig, entry.reply
        if entry.family != self.family or orig.proto != self.proto or orig.dst_port != self.port:
            return False
        if self.dst is not None and orig.dst != packed(self.dst):
            return False
        if self.skip_dsts and orig.dst in _packed_all(self.skip_dsts):
            return False
        if self.dnat_to is not None:
            if not entry.dnated or reply.src != packed(self.dnat_to):
                return False
            # A DNATed entry's reply comes from the endpoint's address and port.
            if self.dnat_port and reply.src_port != self.dnat_port:
                return False
        if self.keep is not None:
            return entry.dnated and reply.src not in _packed_all(self.keep)
        if self.not_nated:
            # A NodePort entry DNATed to an endpoint whose port equals the NodePort is
            # deleted too (only the port tells them apart without the node's addresses).
            if self.dst is not None:
                return reply.src == packed(self.dst)
            return reply.src_port == self.port
        return True


@functools.lru_cache(maxsize=4096)
def packed(ip: str) -> bytes:
    """An address in network order, as the kernel's entries hold it."""
    return ipaddress.ip_address(ip).packed


@functools.lru_cache(maxsize=4096)
def _packed_all(ips: frozenset[str]) -> frozenset[bytes]:
    return frozenset(packed(ip) for ip in ips)


def _targets(sp: ServicePort) -> list[tuple[IPAddress | None, int]]:
    vips: list[tuple[IPAddress | None, int]] = [
        (ip, sp.port) for ip in (*sp.cluster_ips, *sp.external_ips, *sp.load_balancer_ips)
    ]
    if sp.node_port:
        vips.append((None, sp.node_port))
    return vips


def _endpoints(sp: ServicePort | None) -> set[tuple[str, int]]:
    """The (address, port) pairs a port DNATs to: an endpoint is both (upstream's
    cleanup compares IP:port, so a targetPort change on the same pods is a change)."""
    if sp is None:
        return set()
    return {(e.ip, e.port) for e in (*sp.cluster_endpoints, *sp.external_endpoints)}


def _has_endpoints(sp: ServicePort | None) -> bool:
    """Whether `_endpoints(sp)` is not empty (without building it: every port of an agent's
    first sync is asked)."""
    return sp is not None and bool(sp.cluster_endpoints or sp.external_endpoints)


#: The protocol number of each Service protocol (CTA_PROTO_NUM).
PROTOCOL_NUMBERS = {Protocol.TCP: PROTO_TCP, Protocol.UDP: PROTO_UDP, Protocol.SCTP: PROTO_SCTP}


def stale_flows(old: ServicePort | None, new: ServicePort | None) -> list[FlowFilter]:
    """The conntrack deletions a change of one service port calls for (`old` None: the kernel
    may have had no rule for it, as at an agent's start or after a repair)."""
    port = new or old
    if port is None:
        return []
    if port.protocol is not Protocol.UDP:
        if new is None or _has_endpoints(old) or not _has_endpoints(new):
            return []
        proto = PROTOCOL_NUMBERS[port.protocol]
        return [
            FlowFilter(new.family, new.port, ip, not_nated=True, proto=proto)
            for ip in sorted(set(new.cluster_ips))
        ]
    out: set[FlowFilter] = set()
    gone = _endpoints(old) - _endpoints(new)
    for ep, ep_port in gone:
        for dst, p in _targets(old or port):
            out.add(FlowFilter(port.family, p, dst, ep, dnat_port=ep_port))
    if new is not None and not _endpoints(old) and _endpoints(new):
        for dst, p in _targets(new):
            out.add(FlowFilter(port.family, p, dst, not_nated=True))
    return sorted(out, key=lambda f: (f.family, f.port, str(f.dst), str(f.dnat_to)))


def reconcile_flows(
    port: ServicePort,
    serving: frozenset[str],
    udp_addresses: Mapping[int, frozenset[str]] | None = None,
) -> list[FlowFilter]:
    """The deletions for a UDP port the kernel may have had no rule for, or other rules (an
    agent's start: a restart, an upgrade, a mode switch, a takeover): the entries to its
    addresses DNATed to an address that is not one of its serving endpoints (`serving`),
    such as a pod that went away while no agent ran on the node. A client that keeps sending
    (DNS from one socket) keeps such an entry alive, blackholed, for as long as it sends.
    Upstream kube-proxy lists the whole table at every sync for this; kpx does it when a port
    is first programmed (every port at an agent's start), and `stale_flows` follows each
    change after that. Its NodePort is matched by port on any address but those of the UDP
    Service ports on the same port number (`udp_addresses`: port -> addresses,
    `udp_addresses_by_port`), whose entries are theirs, as upstream checks Service addresses
    before NodePorts."""
    if port.protocol is not Protocol.UDP:
        return []
    others = udp_addresses or {}
    return [
        FlowFilter(
            port.family,
            p,
            dst,
            keep=serving,
            skip_dsts=others.get(p, frozenset()) if dst is None else frozenset(),
        )
        for dst, p in _targets(port)
    ]


def udp_addresses_by_port(ports: Iterable[ServicePort]) -> dict[int, frozenset[str]]:
    """Port number -> the addresses (ClusterIPs, external and load-balancer IPs) of the UDP
    Service ports on it."""
    found: dict[int, set[str]] = {}
    for sp in ports:
        if sp.protocol is Protocol.UDP:
            for dst, p in _targets(sp):
                if dst is not None:
                    found.setdefault(p, set()).add(str(dst))
    return {p: frozenset(addresses) for p, addresses in found.items()}


#: Seconds one netlink answer may take (a datagram of a dump, a deletion's acknowledgement), and
#: one batch of deletions all together (conntrack_cleaner runs them after the syncs, off the
#: programming path).
CALL_TIMEOUT = 5.0
BUDGET = 30.0
#: Dumps of one family's table per cleanup while the table's changes interrupt them.
DUMP_ATTEMPTS = 3
#: A datagram of a dump's answer: the kernel fills at most 32 KiB at a time.
_RECEIVE_BYTES = 1 << 16
ENOENT = errno.ENOENT


#: Conntrack entries `delete_flows` deleted since the agent started, per IP family (the
#: kernel's acknowledgements): the metrics read it.
deleted_by_family: Counter[int] = Counter()


class NetlinkConntrack:
    """The socket edge: a dump of one family's table and the deletion of one entry, over one
    NETLINK_NETFILTER socket; the messages are conntrack_wire's."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._seq = 0
        try:
            self.sock.bind((0, 0))
        except OSError:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def _ask(self, request: bytes, deadline: float) -> None:
        self._wait(deadline)
        self.sock.sendto(request, (0, 0))

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the conntrack cleanup's time budget is spent")
        self.sock.settimeout(min(CALL_TIMEOUT, left))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def dump(self, family: int, deadline: float) -> tuple[list[Entry], bool]:
        """The family's entries, and whether the table changed while it was dumped."""
        self._ask(wire.dump_request(family, self._next_seq()), deadline)
        entries: list[Entry] = []
        interrupted = False
        while True:
            self._wait(deadline)
            part = wire.parse_dump(self.sock.recv(_RECEIVE_BYTES))
            entries += part.entries
            interrupted |= part.interrupted
            if part.done:
                return entries, interrupted

    def delete(self, entry: Entry, deadline: float) -> int:
        """Delete one entry: the kernel's errno (0: deleted)."""
        seq = self._next_seq()
        self._ask(wire.delete_request(entry, seq), deadline)
        while True:
            self._wait(deadline)
            acks = wire.parse_ack(self.sock.recv(_RECEIVE_BYTES))
            if seq in acks:
                return acks[seq]


class Conntrack(typing.Protocol):
    """What `delete_flows` needs of the kernel (NetlinkConntrack; a fake in the tests)."""

    def dump(self, family: int, deadline: float) -> tuple[list[Entry], bool]: ...
    def delete(self, entry: Entry, deadline: float) -> int: ...
    def close(self) -> None: ...


def _delete_family(ct: Conntrack, family: int, flows: list[FlowFilter], deadline: float) -> int:
    """Dump the family's table, delete the entries a filter matches; how many failed."""
    # A dump the table's changes interrupted (NLM_F_DUMP_INTR) may lack entries: asked again,
    # as upstream asks up to 3 times; after that what was dumped is still worth cleaning.
    for _ in range(DUMP_ATTEMPTS):
        entries, interrupted = ct.dump(family, deadline)
        if not interrupted:
            break
    else:
        log.info(
            "conntrack cleanup: the IPv%d table changed while it was dumped, %d times",
            family,
            DUMP_ATTEMPTS,
        )
    # Indexed by (protocol, port, destination; None: any, a NodePort's): a repair asks for a
    # filter per ClusterIP, tens of thousands, and the table can hold hundreds of thousands.
    by_key: dict[tuple[int, int, bytes | None], list[FlowFilter]] = {}
    for flow in flows:
        dst = packed(flow.dst) if flow.dst is not None else None
        by_key.setdefault((flow.proto, flow.port, dst), []).append(flow)
    none: list[FlowFilter] = []
    matched = [
        e
        for e in entries
        if any(
            f.matches(e)
            for f in (
                *by_key.get((e.orig.proto, e.orig.dst_port, e.orig.dst), none),
                *by_key.get((e.orig.proto, e.orig.dst_port, None), none),
            )
        )
    ]
    refused: Counter[int] = Counter()
    for done, entry in enumerate(matched):
        try:
            error = ct.delete(entry, deadline)
        except TimeoutError:
            log.warning(
                "conntrack cleanup: %d IPv%d deletions left undone (time budget spent)",
                len(matched) - done,
                family,
            )
            return sum(refused.values()) + len(matched) - done
        if error == 0:
            deleted_by_family[family] += 1
        elif error != ENOENT:  # ENOENT: it expired since the dump
            refused[error] += 1
    for error, count in sorted(refused.items()):
        log.warning(
            "conntrack cleanup: the kernel refused %d IPv%d deletions: %s",
            count,
            family,
            os.strerror(error),
        )
    return sum(refused.values())


def delete_flows(
    filters: Iterable[FlowFilter],
    budget: float = BUDGET,
    connect: Callable[[], Conntrack] = NetlinkConntrack,
) -> int:
    """Delete the entries the filters match, over netlink (one dump per IP family, then one
    deletion per entry, as upstream); returns how many deletions failed. Never raises: a
    socket that cannot be opened or a dump the kernel refuses (no nf_conntrack_netlink, no
    CAP_NET_ADMIN) or garbles fails all of that family's filters at once, and what the time
    budget leaves undone counts as failed; all are logged. The entries deleted are counted in
    `deleted_by_family`."""
    by_family: dict[int, list[FlowFilter]] = {}
    for flow in filters:
        by_family.setdefault(flow.family, []).append(flow)
    if not by_family:
        return 0
    deadline = time.monotonic() + budget
    try:
        ct = connect()
    except OSError as exc:
        undone = sum(map(len, by_family.values()))
        log.warning(
            "conntrack cleanup not done: no netlink socket (%s); %d filters left undone",
            exc,
            undone,
        )
        return undone
    failures = 0
    try:
        for family, flows in sorted(by_family.items()):
            try:
                failures += _delete_family(ct, family, flows, deadline)
            except (OSError, WireError) as exc:
                # TimeoutError (the budget, or a dump's answer that did not come) is an OSError.
                failures += len(flows)
                log.warning(
                    "conntrack cleanup of IPv%d not done (%s); %d filters left undone",
                    family,
                    exc or type(exc).__name__,
                    len(flows),
                )
    finally:
        ct.close()
    return failures
