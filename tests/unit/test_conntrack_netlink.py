"""Stale UDP conntrack deletions over netlink: the ctnetlink codec (golden bytes, pyroute2's
decoder and encoder as the independent reference, malformed answers), the filters' matching,
`delete_flows` against a fake kernel, and the cleaner that runs them off the programming path.
The real kernel: tests/e2e/test_conntrack_netlink_netns.py."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import struct
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyroute2.netlink import NLM_F_MULTI
from pyroute2.netlink.nfnetlink.nfctsocket import nfct_msg
from test_proxier import endpoint_slice, service, setup

from kpx_agent.backends.kernel import netlink as nl
from kpx_agent.conntrack import stale_flows as conntrack
from kpx_agent.conntrack import wire
from kpx_agent.conntrack.cleaner import ConntrackCleaner
from kpx_agent.conntrack.stale_flows import FlowFilter
from kpx_agent.conntrack.wire import Entry, KernelError, Tuple, WireError
from kpx_agent.model.types import IP, Protocol, ServicePort, ServicePortKey
from kpx_agent.store.cluster_state import SERVICES, SLICES

FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

ip = ipaddress.ip_address
CLIENT, VIP, EP1, EP2 = "10.244.0.5", "10.96.0.10", "10.244.1.2", "10.244.2.2"
OTHER = "10.96.0.99"
DNATED = wire.IPS_DST_NAT | wire.IPS_DST_NAT_DONE | 0x8A  # confirmed, seen reply, SNAT done


def udp(family: int, src: str, dst: str, sport: int, dport: int) -> Tuple:
    return Tuple(ip(src).packed, ip(dst).packed, wire.PROTO_UDP, sport, dport)


def entry(
    dst: str,
    dport: int,
    reply_src: str,
    reply_sport: int,
    status: int = DNATED,
    sport: int = 40000,
    client: str = CLIENT,
    proto: int = 17,
) -> Entry:
    family = ip(dst).version
    return Entry(
        family,
        Tuple(ip(client).packed, ip(dst).packed, proto, sport, dport),
        Tuple(ip(reply_src).packed, ip(client).packed, proto, reply_sport, sport),
        status,
        id=abs(hash((dst, dport, reply_src, reply_sport, sport))) % 2**32,
    )


# ---- golden bytes ---------------------------------------------------------------------------

IPV4_DELETE = bytes.fromhex(
    "50000000"
    "0201"
    "0500"
    "07000000"
    "00000000"  # nlmsghdr: 80 bytes, CT_DELETE, REQ|ACK, seq 7
    "02"
    "00"
    "0000"  # nfgenmsg: AF_INET, v0, res_id 0
    "3400"
    "0180"  # CTA_TUPLE_ORIG | NLA_F_NESTED, 52 bytes
    "1400"
    "0180"  # CTA_TUPLE_IP | NESTED
    "0800"
    "0100"
    "0af40005"  # CTA_IP_V4_SRC 10.244.0.5
    "0800"
    "0200"
    "0a60000a"  # CTA_IP_V4_DST 10.96.0.10
    "1c00"
    "0280"  # CTA_TUPLE_PROTO | NESTED
    "0500"
    "0100"
    "11000000"  # CTA_PROTO_NUM 17, padded
    "0600"
    "0200"
    "9c400000"  # CTA_PROTO_SRC_PORT 40000, big-endian, padded
    "0600"
    "0300"
    "00350000"  # CTA_PROTO_DST_PORT 53
    "0800"
    "0c00"
    "1234abcd"  # CTA_ID, big-endian
)
IPV6_DELETE = bytes.fromhex(
    "68000000"
    "0201"
    "0500"
    "08000000"
    "00000000"  # 104 bytes, CT_DELETE, REQ|ACK, seq 8
    "0a"
    "00"
    "0000"  # AF_INET6
    "4c00"
    "0180"  # CTA_TUPLE_ORIG | NESTED
    "2c00"
    "0180"  # CTA_TUPLE_IP | NESTED
    "1400"
    "0300"
    "fd000000000000000000000000000005"  # CTA_IP_V6_SRC fd00::5
    "1400"
    "0400"
    "fd000096000000000000000000000010"  # CTA_IP_V6_DST fd00:96::10
    "1c00"
    "0280"
    "0500"
    "0100"
    "11000000"
    "0600"
    "0200"
    "9c400000"
    "0600"
    "0300"
    "00350000"
    "0600"
    "1200"
    "00070000"  # CTA_ZONE 7, big-endian u16, padded
)


def test_delete_messages_are_the_golden_bytes_and_pyroute2_reads_them() -> None:
    v4 = Entry(
        4, udp(4, CLIENT, VIP, 40000, 53), udp(4, EP1, CLIENT, 5353, 40000), DNATED, id=0x1234ABCD
    )
    assert wire.delete_request(v4, seq=7) == IPV4_DELETE
    v6 = Entry(
        6,
        udp(6, "fd00::5", "fd00:96::10", 40000, 53),
        udp(6, "fd00::1:2", "fd00::5", 5353, 40000),
        DNATED,
        zone=7,
    )
    assert wire.delete_request(v6, seq=8) == IPV6_DELETE
    msg = nfct_msg(IPV4_DELETE)
    msg.decode()
    orig = msg.get_attr("CTA_TUPLE_ORIG")
    assert orig.get_attr("CTA_TUPLE_IP").get_attr("CTA_IP_V4_DST") == VIP
    assert orig.get_attr("CTA_TUPLE_PROTO").get_attr("CTA_PROTO_DST_PORT") == 53
    assert msg.get_attr("CTA_ID") == 0x1234ABCD
    msg = nfct_msg(IPV6_DELETE)
    msg.decode()
    tuple_ip = msg.get_attr("CTA_TUPLE_ORIG").get_attr("CTA_TUPLE_IP")
    assert tuple_ip.get_attr("CTA_IP_V6_SRC") == "fd00::5"


def test_dump_request() -> None:
    assert wire.dump_request(4, seq=3) == bytes.fromhex(
        "1400000001010103030000000000000002000000"  # CT_GET, REQUEST|DUMP
    )
    assert wire.dump_request(6)[16] == 10  # AF_INET6
    with pytest.raises(ValueError, match="IP family 5"):
        wire.dump_request(5)


def pyroute2_entry(e: Entry, flags: int = NLM_F_MULTI) -> bytes:
    """A dump's entry as pyroute2 encodes it (the independent encoder)."""
    v = "V4" if e.family == 4 else "V6"

    def tuple_attr(t: Tuple) -> dict[str, Any]:
        return {
            "attrs": [
                (
                    "CTA_TUPLE_IP",
                    {
                        "attrs": [
                            (f"CTA_IP_{v}_SRC", str(ip(t.src))),
                            (f"CTA_IP_{v}_DST", str(ip(t.dst))),
                        ]
                    },
                ),
                (
                    "CTA_TUPLE_PROTO",
                    {
                        "attrs": [
                            ("CTA_PROTO_NUM", t.proto),
                            ("CTA_PROTO_SRC_PORT", t.src_port),
                            ("CTA_PROTO_DST_PORT", t.dst_port),
                        ]
                    },
                ),
            ]
        }

    msg = nfct_msg()
    msg["header"]["type"] = wire.NFNL_SUBSYS_CTNETLINK << 8 | wire.IPCTNL_MSG_CT_NEW
    msg["header"]["flags"] = flags
    msg["nfgen_family"] = wire.AF[e.family]
    msg["attrs"] = [
        ("CTA_TUPLE_ORIG", tuple_attr(e.orig)),
        ("CTA_TUPLE_REPLY", tuple_attr(e.reply)),
        ("CTA_STATUS", e.status),
        ("CTA_ID", e.id),
    ]
    if e.zone:
        msg["attrs"].append(("CTA_ZONE", e.zone))
    msg.encode()
    return bytes(msg.data)


DONE = struct.pack("=IHHIIi", 20, wire.NLMSG_DONE, NLM_F_MULTI, 1, 0, 0)


def error_message(code: int, seq: int = 1) -> bytes:
    return struct.pack("=IHHIIi", 36, wire.NLMSG_ERROR, 0, seq, 0, -code) + bytes(16)


addresses4 = st.ip_addresses(v=4).map(lambda a: a.packed)
addresses6 = st.ip_addresses(v=6).map(lambda a: a.packed)
ports = st.integers(0, 65535)


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    family = draw(st.sampled_from([4, 6]))
    addrs = addresses4 if family == 4 else addresses6
    proto = draw(st.sampled_from([6, 17, 132]))

    def one() -> Tuple:
        return Tuple(draw(addrs), draw(addrs), proto, draw(ports), draw(ports))

    return Entry(
        family,
        one(),
        one(),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 65535)),
    )


@FUZZ
@given(st.lists(entries(), max_size=5), st.booleans())
def test_dump_round_trip_through_pyroute2(dumped: list[Entry], done: bool) -> None:
    data = b"".join(map(pyroute2_entry, dumped)) + (DONE if done else b"")
    part = wire.parse_dump(data)
    assert part.entries == dumped and part.done == done and not part.interrupted
    for e in dumped:
        msg = nfct_msg(wire.delete_request(e))
        msg.decode()
        proto = msg.get_attr("CTA_TUPLE_ORIG").get_attr("CTA_TUPLE_PROTO")
        assert proto.get_attr("CTA_PROTO_SRC_PORT") == e.orig.src_port
        assert msg.get_attr("CTA_ID") == e.id


def test_kernel_answers() -> None:
    with pytest.raises(KernelError) as refused:
        wire.parse_dump(error_message(errno.EPERM))
    assert refused.value.errno == errno.EPERM
    failed = struct.pack("=IHHIIi", 20, wire.NLMSG_DONE, NLM_F_MULTI, 1, 0, -errno.EINTR)
    with pytest.raises(KernelError, match="ended with an error"):
        wire.parse_dump(failed)
    interrupted = pyroute2_entry(entry(VIP, 53, EP1, 5353), NLM_F_MULTI | wire.NLM_F_DUMP_INTR)
    assert wire.parse_dump(interrupted).interrupted
    assert wire.parse_ack(error_message(0, 5) + error_message(errno.ENOENT, 6)) == {
        5: 0,
        6: errno.ENOENT,
    }


GOOD = pyroute2_entry(entry(VIP, 53, EP1, 5353))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (GOOD[:10], "shorter than its 16-byte header"),
        (GOOD[:-4], "does not fit"),
        (struct.pack("=IHHII", 8, 0x100, 0, 0, 0), "length 8 does not fit"),
        (GOOD + struct.pack("=IHHII", 16, 0x999, 0, 0, 0), "type 0x999, not a conntrack entry"),
        (struct.pack("=IHHII", 18, 0x100, 0, 0, 0) + b"\x02\x00", "shorter than its nfgenmsg"),
        (struct.pack("=IHHII", 20, 0x100, 0, 0, 0) + b"\x07\x00\x00\x00", "address family 7"),
        (
            struct.pack("=IHHII", 20, 0x100, 0, 0, 0) + b"\x02\x00\x00\x00",
            "no original and reply tuple",
        ),
        (
            struct.pack("=IHHIIBBHHH", 24, 0x100, 0, 0, 0, 2, 0, 0, 40, 1),
            "attribute 1 says length 40",
        ),
        (struct.pack("=IHHII", 16, wire.NLMSG_ERROR, 0, 0, 0), "no error code"),
    ],
)
def test_malformed_answers_are_wire_errors_naming_the_place(data: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        wire.parse_dump(data)


def test_malformed_attributes_name_the_attribute() -> None:
    """Entries rebuilt by hand with one attribute wrong; the other tuple is a good one."""
    head = b"\x02\x00\x00\x00"  # nfgenmsg, AF_INET
    reply = nl.nested(wire.CTA_TUPLE_REPLY, wire.tuple_attrs(4, udp(4, EP1, CLIENT, 53, 9)))
    bad_ip = nl.nested(
        wire.CTA_TUPLE_IP,
        nl.attr(wire.CTA_IP_V4_SRC, b"\x0a\x00\x00") + nl.attr(wire.CTA_IP_V4_DST, ip(VIP).packed),
    )
    body = head + nl.nested(wire.CTA_TUPLE_ORIG, bad_ip) + reply
    with pytest.raises(WireError, match=r"CTA_TUPLE_ORIG\.CTA_TUPLE_IP\.src: 3 bytes, expected 4"):
        wire.parse_entry(body)
    addrs = nl.attr(1, ip(CLIENT).packed) + nl.attr(2, ip(VIP).packed)
    no_proto = head + nl.nested(wire.CTA_TUPLE_ORIG, nl.nested(wire.CTA_TUPLE_IP, addrs))
    with pytest.raises(WireError, match=r"CTA_TUPLE_ORIG: no protocol number"):
        wire.parse_entry(no_proto + reply)
    with pytest.raises(WireError, match="no original and reply tuple"):
        wire.parse_entry(no_proto)
    good_orig = nl.nested(wire.CTA_TUPLE_ORIG, wire.tuple_attrs(4, udp(4, CLIENT, VIP, 9, 53)))
    with pytest.raises(WireError, match=r"CTA_STATUS: 2 bytes, expected 4"):
        wire.parse_entry(head + good_orig + reply + nl.attr(wire.CTA_STATUS, b"\x00\x01"))
    assert wire.parse_entry(head + good_orig + reply).orig == udp(4, CLIENT, VIP, 9, 53)


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_give_an_answer_or_a_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError, KernelError):
        wire.parse_dump(data)
    with contextlib.suppress(WireError):
        wire.parse_ack(data)


@FUZZ
@given(st.data())
def test_corrupted_dumps_give_an_answer_or_a_wire_error(data: st.DataObject) -> None:
    """A real dump with bytes overwritten or cut: nothing but the codec's errors escapes."""
    v6 = entry("fd00::10", 53, "fd00::1:2", 5353, client="fd00::5")
    raw = bytearray(GOOD + pyroute2_entry(v6) + DONE)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    with contextlib.suppress(WireError, KernelError):
        wire.parse_dump(bytes(raw))


# ---- which entries a filter deletes (the semantics of the former `conntrack -D` options) -----


def test_a_filter_for_a_gone_endpoint_matches_only_entries_dnated_to_its_address_and_port() -> None:
    flow = FlowFilter(4, 53, IP.of(VIP), IP.of(EP1), dnat_port=5353)
    assert flow.matches(entry(VIP, 53, EP1, 5353))
    assert not flow.matches(entry(VIP, 53, EP1, 6363))  # the same pod, another targetPort
    assert not flow.matches(entry(VIP, 53, EP2, 5353))  # another endpoint
    assert not flow.matches(entry(VIP, 54, EP1, 5353))  # another service port
    assert not flow.matches(entry("10.96.0.11", 53, EP1, 5353))  # another VIP
    assert not flow.matches(entry(VIP, 53, EP1, 5353, proto=6))  # TCP
    assert not flow.matches(entry(VIP, 53, EP1, 5353, status=0x0A))  # no DNAT done
    any_port = FlowFilter(4, 53, IP.of(VIP), IP.of(EP1))
    assert any_port.matches(entry(VIP, 53, EP1, 6363))
    # A NodePort: any destination address on the node.
    node_port = FlowFilter(4, 30053, None, IP.of(EP1), dnat_port=5353)
    assert node_port.matches(entry("192.168.1.10", 30053, EP1, 5353))
    assert not node_port.matches(entry("192.168.1.10", 30053, EP2, 5353))


def test_a_filter_for_zero_to_some_endpoints_matches_only_entries_not_dnated() -> None:
    flow = FlowFilter(4, 53, IP.of(VIP), not_nated=True)
    assert flow.matches(entry(VIP, 53, VIP, 53, status=0x188))  # rejected/unrouted: reply from VIP
    assert not flow.matches(entry(VIP, 53, EP1, 5353))  # a live flow DNATed to an endpoint
    node_port = FlowFilter(4, 30053, None, not_nated=True)
    assert node_port.matches(entry("192.168.1.10", 30053, "192.168.1.10", 30053, status=0x188))
    assert not node_port.matches(entry("192.168.1.10", 30053, EP1, 5353))
    # Only the port tells them apart without the node's addresses (as before).
    assert node_port.matches(entry("192.168.1.10", 30053, EP1, 30053))


def test_a_reconcile_filter_matches_only_entries_dnated_to_an_address_it_does_not_keep() -> None:
    flow = FlowFilter(4, 53, IP.of(VIP), keep=frozenset({EP2}))
    assert flow.matches(entry(VIP, 53, EP1, 5353))  # DNATed to a pod gone meanwhile
    assert not flow.matches(entry(VIP, 53, EP2, 5353))  # a serving endpoint: a live flow
    assert not flow.matches(entry(VIP, 53, EP2, 6363))  # the address decides, as upstream's
    assert not flow.matches(entry(VIP, 53, VIP, 53, status=0x188))  # not DNATed: not its job
    assert not flow.matches(entry(VIP, 54, EP1, 5353))  # another service port
    assert not flow.matches(entry(VIP, 53, EP1, 5353, proto=6))  # TCP
    none_serving = FlowFilter(4, 53, IP.of(VIP), keep=frozenset())
    assert none_serving.matches(entry(VIP, 53, EP2, 5353))
    node_port = FlowFilter(4, 30053, None, keep=frozenset({EP2}))
    assert node_port.matches(entry("192.168.1.10", 30053, EP1, 5353))
    assert not node_port.matches(entry("192.168.1.10", 30053, EP2, 5353))


def test_reconcile_filters_cover_every_address_of_a_udp_port_and_no_tcp_port() -> None:
    key = ServicePortKey("k", "dns", "dns", Protocol.UDP, 4)
    port = ServicePort(
        key,
        53,
        cluster_ips=(IP.of(VIP),),
        external_ips=(IP.of("192.0.2.7"),),
        load_balancer_ips=(IP.of("198.51.100.9"),),
        node_port=30053,
    )
    serving = frozenset({EP1})
    # another UDP Service's ClusterIP on port 30053: its entries are not the NodePort's
    other = ServicePort(ServicePortKey("k", "o", "", Protocol.UDP, 4), 30053, (IP.of(OTHER),))
    udp_addresses = conntrack.udp_addresses_by_port([port, other])
    assert udp_addresses == {
        53: frozenset({VIP, "192.0.2.7", "198.51.100.9"}),
        30053: frozenset({OTHER}),
    }
    flows = conntrack.reconcile_flows(port, serving, udp_addresses)
    assert {(f.dst, f.port, f.skip_dsts) for f in flows} == {
        (VIP, 53, frozenset()),
        ("192.0.2.7", 53, frozenset()),
        ("198.51.100.9", 53, frozenset()),
        (None, 30053, frozenset({OTHER})),
    }
    assert all(f.keep is serving and f.family == 4 and f.proto == wire.PROTO_UDP for f in flows)
    (node_port,) = [f for f in flows if f.dst is None]
    assert node_port.matches(entry("192.168.1.10", 30053, EP2, 5353))
    assert not node_port.matches(entry(OTHER, 30053, EP2, 5353))  # the other Service's flow
    tcp = ServicePort(ServicePortKey("k", "web", "", Protocol.TCP, 4), 80, (IP.of(VIP),))
    assert conntrack.reconcile_flows(tcp, serving) == []


def test_ipv6_filters_match_ipv6_entries_only() -> None:
    flow = FlowFilter(6, 53, IP.of("fd00:96::10"), IP.of("fd00::1:2"), dnat_port=5353)
    assert flow.matches(entry("fd00:96::10", 53, "fd00::1:2", 5353, client="fd00::5"))
    assert not FlowFilter(4, 53, None, IP.of(EP1)).matches(
        entry("fd00:96::10", 53, "fd00::1:2", 5353, client="fd00::5")
    )


# ---- delete_flows against a fake kernel -----------------------------------------------------


class FakeConntrack:
    def __init__(
        self,
        table: list[Entry],
        refuse: int = 0,
        dump_error: Exception | None = None,
        delete_seconds: float = 0.0,
    ) -> None:
        self.table = list(table)
        self.refuse = refuse
        self.dump_error = dump_error
        self.delete_seconds = delete_seconds
        self.dumps: list[int] = []
        self.closed = False

    def dump(self, family: int, deadline: float) -> tuple[list[Entry], bool]:
        self.dumps.append(family)
        if self.dump_error is not None:
            raise self.dump_error
        return [e for e in self.table if e.family == family], False

    def delete(self, e: Entry, deadline: float) -> int:
        time.sleep(self.delete_seconds)
        if time.monotonic() > deadline:
            raise TimeoutError("budget")
        if self.refuse:
            return self.refuse
        if e not in self.table:
            return errno.ENOENT
        self.table.remove(e)
        return 0

    def close(self) -> None:
        self.closed = True


GONE_EP1 = [
    FlowFilter(4, 53, IP.of(VIP), IP.of(EP1), dnat_port=5353),
    FlowFilter(4, 30053, None, IP.of(EP1), dnat_port=5353),
]


def test_delete_flows_deletes_exactly_the_matching_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conntrack, "deleted_by_family", deleted := conntrack.Counter[int]())
    to_ep1 = [entry(VIP, 53, EP1, 5353, sport=p) for p in (40000, 40001)]
    node_port = entry("192.168.1.10", 30053, EP1, 5353)
    others = [entry(VIP, 53, EP2, 5353), entry(VIP, 53, EP1, 6363), entry(VIP, 53, VIP, 53, 0)]
    v6 = entry("fd00:96::10", 53, "fd00::1:2", 5353, client="fd00::5")
    fake = FakeConntrack([*to_ep1, node_port, *others, v6])
    assert conntrack.delete_flows(GONE_EP1, connect=lambda: fake) == 0
    assert fake.table == [*others, v6] and fake.dumps == [4] and fake.closed
    assert deleted == {4: 3}


def test_kernel_refusals_are_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeConntrack(
        [entry(VIP, 53, EP1, 5353), entry(VIP, 53, EP1, 5353, sport=2)], refuse=errno.EPERM
    )
    assert conntrack.delete_flows(GONE_EP1, connect=lambda: fake) == 2
    assert "refused 2 IPv4 deletions: Operation not permitted" in caplog.text
    for error in (
        KernelError(errno.EINVAL, "no ctnetlink"),
        WireError("garbled"),
        TimeoutError("no answer"),
    ):
        failing = FakeConntrack([], dump_error=error)
        assert conntrack.delete_flows(GONE_EP1, connect=lambda f=failing: f) == 2  # both filters
        assert failing.closed


def test_an_interrupted_dump_is_asked_again_before_deleting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dump the table's changes interrupted may lack the entry to delete (a busy node): it
    is asked again, up to 3 times, as upstream does; then what was dumped is cleaned."""
    caplog.set_level("INFO")
    missed, seen = entry(VIP, 53, EP1, 5353, sport=40000), entry(VIP, 53, EP1, 5353, sport=40001)
    fake = FakeConntrack([missed, seen])
    answers = [([seen], True), ([missed, seen], False)]
    fake.dump = lambda family, deadline: answers.pop(0)  # type: ignore[method-assign]
    assert conntrack.delete_flows(GONE_EP1, connect=lambda: fake) == 0
    assert fake.table == []
    always = FakeConntrack([missed, seen])
    calls: list[int] = []

    def interrupted(family: int, deadline: float) -> tuple[list[Entry], bool]:
        calls.append(family)
        return [seen], True

    always.dump = interrupted  # type: ignore[method-assign]
    assert conntrack.delete_flows(GONE_EP1, connect=lambda: always) == 0
    assert calls == [4, 4, 4] and always.table == [missed]
    assert "the IPv4 table changed while it was dumped, 3 times" in caplog.text


def test_an_entry_gone_since_the_dump_is_not_a_failure() -> None:
    e = entry(VIP, 53, EP1, 5353)
    fake = FakeConntrack([e])
    fake.dump = lambda family, deadline: ([e, e], False)  # type: ignore[method-assign]
    assert conntrack.delete_flows(GONE_EP1, connect=lambda: fake) == 0  # the 2nd: ENOENT


def test_no_netlink_socket_fails_everything_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_socket() -> FakeConntrack:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    assert conntrack.delete_flows(GONE_EP1, connect=no_socket) == 2
    assert "no netlink socket" in caplog.text
    assert conntrack.delete_flows([], connect=no_socket) == 0  # nothing to do: no socket


def test_the_budget_bounds_the_deletions(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that only the deletions move (0.02 s each, a 0.05 s budget): two fit, the
    third runs out of time, and no deletion is tried after that; the eight undone fail."""
    now = [1000.0]
    monkeypatch.setattr(conntrack, "time", SimpleNamespace(monotonic=lambda: now[0]))
    tried: list[Entry] = []

    class SlowConntrack(FakeConntrack):
        def delete(self, e: Entry, deadline: float) -> int:
            tried.append(e)
            now[0] += 0.02
            if now[0] > deadline:
                raise TimeoutError("budget")
            return super().delete(e, deadline=float("inf"))

    table = [entry(VIP, 53, EP1, 5353, sport=p) for p in range(40000, 40010)]
    fake = SlowConntrack(table)
    failures = conntrack.delete_flows(GONE_EP1, budget=0.05, connect=lambda: fake)
    assert len(tried) == 3  # two done, the third past the budget, then none
    assert failures == len(fake.table) == 8


# ---- the cleaner: off the programming path --------------------------------------------------


def test_submit_never_waits_for_the_deletions() -> None:
    release, started = threading.Event(), threading.Event()
    batches: list[list[FlowFilter]] = []
    reports: list[tuple[list[int], int]] = []

    def delete(flows: list[FlowFilter]) -> int:
        started.set()
        release.wait(10)
        batches.append(flows)
        return 1

    cleaner = ConntrackCleaner(delete, lambda fam, secs, failed: reports.append((fam, failed)))
    cleaner.submit(GONE_EP1[:1])
    assert started.wait(30)
    cleaner.submit(GONE_EP1)  # while the first batch hangs: queued, not waited for
    cleaner.submit(GONE_EP1)  # the same filters again: once
    assert not cleaner.idle(0.05)  # both submits returned while the first batch hangs
    release.set()
    assert cleaner.idle(10)
    assert batches == [GONE_EP1[:1], GONE_EP1]
    assert reports == [([4], 1), ([4], 1)]


def test_a_full_queue_drops_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    reports: list[int] = []
    cleaner = ConntrackCleaner(
        lambda flows: release.wait(10) and 0,
        lambda fam, secs, failed: reports.append(failed),
        capacity=3,
    )
    flows = [FlowFilter(4, 53, IP.of(VIP), IP.of(f"10.244.1.{i}")) for i in range(8)]
    cleaner.submit(flows[:1])  # taken by the worker at once (or queued)
    time.sleep(0.05)
    cleaner.submit(flows[1:])
    release.set()
    assert cleaner.idle(10)
    # 8 filters, at most 1 running and 3 waiting: the other 4 or more refused, reported
    assert sum(reports) >= 4 and "queue full" in caplog.text


def test_a_crashing_deletion_is_logged_and_counted_and_the_worker_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reports: list[int] = []
    calls = 0

    def delete(flows: list[FlowFilter]) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return 0

    cleaner = ConntrackCleaner(delete, lambda fam, secs, failed: reports.append(failed))
    with caplog.at_level(logging.ERROR):
        cleaner.submit(GONE_EP1)
        assert cleaner.idle(10)
    cleaner.submit(GONE_EP1[:1])
    assert cleaner.idle(10)
    assert reports == [2, 0] and "a bug" in caplog.text


def test_a_sync_is_not_held_up_by_a_hanging_conntrack_cleanup() -> None:
    """The proxier hands the filters over and returns; the next sync does not wait either."""
    release = threading.Event()
    seen: list[FlowFilter] = []

    def hangs(flows: Iterable[FlowFilter]) -> int:
        release.wait(30)
        seen.extend(flows)
        return 0

    state, _, proxier, _ = setup()
    proxier.delete_flows = hangs
    state.upsert(SERVICES, service("k", "dns", "UDP"))
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.1.2", "10.244.2.2", proto="UDP"))
    assert proxier.sync().ok
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.2.2", proto="UDP"))
    assert proxier.sync().ok  # returned while the cleanup hangs (it waits for `release`)
    assert seen == [] and not proxier.conntrack_cleaner.idle(0.05)
    release.set()
    assert proxier.conntrack_cleaner.idle(10)
    assert {str(f.dnat_to) for f in seen if f.dnat_to} == {"10.244.1.2"}
