"""Look up kpx's nftables elements straight over netlink: one element, or a count.

`nft get element` in nftables 1.0.6 first loads every element of the table into its cache
(about 1.2 s with 100,000 endpoints), and `nft list map` prints them all; neither can time a
change to the millisecond. This helper asks the kernel directly, as `nft get element` does
after its cache: NFT_MSG_GETSETELEM for one key (a kernel hash lookup), or a dump of one set
that is only counted. It runs inside the node's network namespace (its socket belongs there):

    ip netns exec NS python3 bench/nft_lookup.py

and answers one line per request line on stdin:

    endpoint VIP PORT BUCKET COUNT -> "IP PORT" of key VIP . tcp . PORT . BUCKET in the map
                                   `endpoints-COUNT` (a Service with COUNT endpoints), or
                                   "absent"
    endpoints VIP PORT COUNT   ->  buckets 0..COUNT-1 of VIP . tcp . PORT in `endpoints-COUNT`,
                                   space-separated, each "IP:PORT" or "-"
    count PORT                 ->  how many `service-ips` elements are VIP . tcp . PORT
                                   (0 when the table does not exist yet)

It only reads; it never changes the ruleset.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct
import sys
from collections.abc import Iterator

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_GETSETELEM = 13
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLA_F_NESTED = 0x8000
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA = 1, 2
NFTA_DATA_VALUE = 1
NFPROTO_IPV4 = 2
IPPROTO_TCP = 6
TABLE = "kpx"
_HDR = struct.Struct("=IHHII")
_ATTR = struct.Struct("=HH")


def _attr(kind: int, payload: bytes, nested: bool = False) -> bytes:
    head = _ATTR.pack(_ATTR.size + len(payload), kind | (NLA_F_NESTED if nested else 0))
    return head + payload + b"\0" * (-len(payload) % 4)


def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    while pos + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, pos)
        if length < _ATTR.size:
            return
        yield kind & ~NLA_F_NESTED, data[pos + _ATTR.size : pos + length]
        pos += (length + 3) & ~3


def _reg(value: bytes) -> bytes:
    """One field of a concatenated key: padded to a 32-bit register."""
    return value + b"\0" * (-len(value) % 4)


def vip_key(vip: str, port: int) -> bytes:
    """The key VIP . tcp . PORT (ipv4_addr . inet_proto . inet_service)."""
    return (
        ipaddress.IPv4Address(vip).packed
        + _reg(bytes([IPPROTO_TCP]))
        + _reg(struct.pack("!H", port))
    )


class Netlink:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self.seq = itertools.count(1)

    def request(self, flags: int, set_name: str, extra: bytes = b"") -> Iterator[bytes]:
        """Send one GETSETELEM; yield the payload of each answer until the ack or DONE.

        Raises OSError with the kernel's errno on a negative acknowledgement."""
        seq = next(self.seq)
        body = struct.pack("=BBH", NFPROTO_IPV4, 0, 0)
        body += _attr(NFTA_SET_ELEM_LIST_TABLE, TABLE.encode() + b"\0")
        body += _attr(NFTA_SET_ELEM_LIST_SET, set_name.encode() + b"\0") + extra
        kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETSETELEM
        self.sock.send(_HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body)
        while True:
            data = self.sock.recv(1 << 20)
            pos = 0
            while pos + _HDR.size <= len(data):
                length, mtype, _flags, mseq, _pid = _HDR.unpack_from(data, pos)
                payload = data[pos + _HDR.size : pos + length]
                pos += (length + 3) & ~3
                if mseq != seq:
                    continue
                if mtype == NLMSG_DONE:
                    return
                if mtype == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code:
                        raise OSError(code, errno.errorcode.get(code, str(code)))
                    return
                yield payload[4:]  # after the nfgenmsg header

    def elements(self, payloads: Iterator[bytes]) -> Iterator[tuple[bytes, bytes]]:
        """(key, data) of each element in GETSETELEM answers (data is b'' for sets)."""
        for payload in payloads:
            for kind, value in _attrs(payload):
                if kind != NFTA_SET_ELEM_LIST_ELEMENTS:
                    continue
                for _, elem in _attrs(value):
                    parts = dict(_attrs(elem))
                    key = dict(_attrs(parts.get(NFTA_SET_ELEM_KEY, b""))).get(NFTA_DATA_VALUE, b"")
                    data = dict(_attrs(parts.get(NFTA_SET_ELEM_DATA, b""))).get(
                        NFTA_DATA_VALUE, b""
                    )
                    yield key, data

    def endpoint(self, vip: str, port: int, bucket: int, count: int) -> str:
        key = vip_key(vip, port) + struct.pack("=I", bucket)  # numgen: host byte order
        elem = _attr(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, key), nested=True)
        extra = _attr(
            NFTA_SET_ELEM_LIST_ELEMENTS, _attr(NFTA_LIST_ELEM, elem, nested=True), nested=True
        )
        try:
            found = list(self.elements(self.request(NLM_F_ACK, f"endpoints-{count}", extra)))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return "absent"
            raise
        if not found or len(found[0][1]) < 6:
            return "absent"
        data = found[0][1]
        return f"{ipaddress.IPv4Address(data[:4])} {struct.unpack('!H', data[4:6])[0]}"

    def count(self, port: int) -> int:
        suffix = vip_key("0.0.0.0", port)[4:]
        try:
            return sum(
                1
                for key, _ in self.elements(self.request(NLM_F_DUMP, "service-ips"))
                if key[4:] == suffix
            )
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return 0
            raise


def answer(nl: Netlink, line: str) -> str:
    words = line.split()
    try:
        if words[:1] == ["endpoint"] and len(words) == 5:
            return nl.endpoint(words[1], int(words[2]), int(words[3]), int(words[4]))
        if words[:1] == ["endpoints"] and len(words) == 4:
            vip, port, count = words[1], int(words[2]), int(words[3])
            found = [nl.endpoint(vip, port, b, count) for b in range(count)]
            return " ".join("-" if f == "absent" else f.replace(" ", ":") for f in found)
        if words[:1] == ["count"] and len(words) == 2:
            return str(nl.count(int(words[1])))
    except (OSError, ValueError) as exc:
        return f"error {exc}"
    return f"error bad request {line.strip()!r}"


def main() -> int:
    nl = Netlink()
    print("ready", flush=True)
    for line in sys.stdin:
        print(answer(nl, line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
