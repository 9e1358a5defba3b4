"""Read what kpx or upstream kube-proxy programmed, straight from the kernel over netlink.

bench/compare.py runs this helper inside a node's network namespace (its netlink socket belongs
there) to time cold starts and changes of both systems, in both modes, to the millisecond:

    ip netns exec NS python3 bench/kernel_probe.py

It answers one line per request line on stdin, and only reads (it never changes the ruleset):

    count FAMILY TABLE SET PORT          -> how many elements of SET have the key
                                            <IPv4> . tcp . PORT (nftables service maps);
                                            0 when the table or set does not exist yet
    rules FAMILY TABLE CHAIN             -> how many rules CHAIN holds (0 when absent)
    dnat FAMILY TABLE CHAIN              -> the endpoints CHAIN DNATs to, following jumps,
                                            gotos, anonymous verdict maps and anonymous
                                            `numgen ... map { ... }` DNAT maps: sorted
                                            "IP:PORT" words, "-" when there are none
    buckets TABLE SET VIP PORT COUNT     -> kpx's map SET (`endpoints-COUNT`, ip family) for
                                            VIP . tcp . PORT . b, b in 0..COUNT-1: "IP:PORT"
                                            or "-" each

FAMILY is `ip` or `ip6`. iptables-nft keeps its tables (`nat`, `filter`) in nftables, so the
same requests read iptables chains (`dnat ip nat KUBE-SVC-...`); an xt `DNAT` target is
decoded from its revision 0, 1 or 2 struct.

Why netlink rather than `nft` or `iptables-save`: both load and print every object first
(seconds at 10,000 Services); a filtered rule dump of one chain, or an element lookup, costs
about a millisecond whatever the size of the ruleset.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from kpx_agent.backends.kernel import netlink as nl
from kpx_agent.backends.kernel.names import NFT_FAMILIES

NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_GETRULE = 7
NFT_MSG_GETSETELEM = 13
FAMILIES = {NFT_FAMILIES[4]: socket.AF_INET, NFT_FAMILIES[6]: socket.AF_INET6}

NFTA_RULE_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS = 1, 2, 4
NFTA_LIST_ELEM = 1
NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 2
NFTA_IMMEDIATE_DREG, NFTA_IMMEDIATE_DATA = 1, 2
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFT_JUMP, NFT_GOTO = -3, -4
NFTA_LOOKUP_SET, NFTA_LOOKUP_DREG = 1, 3
NFTA_NAT_REG_ADDR_MIN, NFTA_NAT_REG_PROTO_MIN = 3, 5
NFTA_TARGET_NAME, NFTA_TARGET_REV, NFTA_TARGET_INFO = 1, 2, 3
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA = 1, 2
NFT_REG_VERDICT = 0
NFT_REG32_00 = 8
NF_NAT_RANGE_MAP_IPS, NF_NAT_RANGE_PROTO_SPECIFIED = 1, 2
MAX_DEPTH = 4  # KUBE-SERVICES -> KUBE-SVC -> KUBE-SEP is two jumps
IPPROTO_TCP = 6
_BE32 = struct.Struct("!I")
_BE32S = struct.Struct("!i")


# ---- netlink attributes and keys -----------------------------------------------------------------


def _attr(kind: int, payload: bytes, nested: bool = False) -> bytes:
    return nl.nested(kind, payload) if nested else nl.attr(kind, payload)


_attrs = nl.attributes


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


# ---- decoding (pure: bytes in, values out) -----------------------------------------------------


def reg_offset(reg: int) -> int:
    """Byte offset of an nftables register in the 64-byte register file (NFT_REG_1..4 are 16
    bytes each, NFT_REG32_00..15 are 4 bytes each and overlap them)."""
    if reg >= NFT_REG32_00:
        return (reg - NFT_REG32_00) * 4
    return (reg - 1) * 16


@dataclass(frozen=True)
class Verdict:
    code: int
    chain: str = ""


def decode_data(data: bytes) -> bytes | Verdict:
    """An nft_data attribute: a value (bytes) or a verdict."""
    attrs = dict(_attrs(data))
    if NFTA_DATA_VERDICT in attrs:
        verdict = dict(_attrs(attrs[NFTA_DATA_VERDICT]))
        code = _BE32S.unpack(verdict.get(NFTA_VERDICT_CODE, b"\0\0\0\0"))[0]
        chain = verdict.get(NFTA_VERDICT_CHAIN, b"").rstrip(b"\0").decode()
        return Verdict(code, chain)
    return attrs.get(NFTA_DATA_VALUE, b"")


def _be32(attrs: dict[int, bytes], kind: int) -> int | None:
    value = attrs.get(kind)
    return _BE32.unpack(value[:4])[0] if value is not None and len(value) >= 4 else None


def xt_dnat_target(rev: int, info: bytes) -> str | None:
    """'IP:PORT' of an xt DNAT target's info (IPv4; revision 0 = nf_nat_ipv4_multi_range_compat,
    1 = nf_nat_range, 2 = nf_nat_range2); None when it maps no address."""
    if rev == 0:
        if len(info) < 20:
            return None
        flags = struct.unpack_from("=I", info, 4)[0]
        addr, port_off = info[8:12], 16
    else:
        if len(info) < 38:
            return None
        flags = struct.unpack_from("=I", info, 0)[0]
        addr, port_off = info[4:8], 36
    if not flags & NF_NAT_RANGE_MAP_IPS:
        return None
    ip = str(ipaddress.IPv4Address(addr))
    if flags & NF_NAT_RANGE_PROTO_SPECIFIED:
        return f"{ip}:{struct.unpack_from('!H', info, port_off)[0]}"
    return ip


@dataclass
class RuleSummary:
    """What one rule can lead to: chains it jumps/goes to, literal DNAT endpoints, and
    anonymous maps whose elements are the DNAT endpoints (set name, address and port offsets
    within each element's data) or verdicts (offset None)."""

    chains: list[str] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    dnat_maps: list[tuple[str, int, int | None]] = field(default_factory=list)
    verdict_maps: list[str] = field(default_factory=list)


def summarize_rule(payload: bytes) -> RuleSummary:
    """Decode one NFT_MSG_NEWRULE payload (after the nfgenmsg header)."""
    out = RuleSummary()
    attrs = dict(_attrs(payload))
    regs = bytearray(64)
    lookups: dict[int, str] = {}  # register offset -> anonymous map whose data it received
    for _, elem in _attrs(attrs.get(NFTA_RULE_EXPRESSIONS, b"")):
        expr = dict(_attrs(elem))
        name = expr.get(NFTA_EXPR_NAME, b"").rstrip(b"\0").decode()
        data = dict(_attrs(expr.get(NFTA_EXPR_DATA, b"")))
        if name == "immediate":
            value = decode_data(data.get(NFTA_IMMEDIATE_DATA, b""))
            dreg = _be32(data, NFTA_IMMEDIATE_DREG)
            if isinstance(value, Verdict):
                if value.code in (NFT_JUMP, NFT_GOTO) and value.chain:
                    out.chains.append(value.chain)
            elif dreg is not None and dreg != NFT_REG_VERDICT:
                off = reg_offset(dreg)
                regs[off : off + len(value)] = value
                lookups = {o: s for o, s in lookups.items() if not off <= o < off + len(value)}
        elif name == "lookup":
            set_name = data.get(NFTA_LOOKUP_SET, b"").rstrip(b"\0").decode()
            dreg = _be32(data, NFTA_LOOKUP_DREG)
            if dreg == NFT_REG_VERDICT:
                out.verdict_maps.append(set_name)
            elif dreg is not None:
                lookups[reg_offset(dreg)] = set_name
        elif name == "nat":
            addr_reg = _be32(data, NFTA_NAT_REG_ADDR_MIN)
            port_reg = _be32(data, NFTA_NAT_REG_PROTO_MIN)
            if addr_reg is None:
                continue
            a_off = reg_offset(addr_reg)
            p_off = reg_offset(port_reg) if port_reg is not None else None
            base = max((o for o in lookups if o <= a_off), default=None)
            if base is not None:
                out.dnat_maps.append(
                    (lookups[base], a_off - base, None if p_off is None else p_off - base)
                )
            else:
                ip = str(ipaddress.IPv4Address(bytes(regs[a_off : a_off + 4])))
                if p_off is None:
                    out.endpoints.append(ip)
                else:
                    out.endpoints.append(f"{ip}:{struct.unpack_from('!H', regs, p_off)[0]}")
        elif name == "target":
            target = data.get(NFTA_TARGET_NAME, b"").rstrip(b"\0").decode()
            if target == "DNAT":
                rev = _be32(data, NFTA_TARGET_REV) or 0
                ep = xt_dnat_target(rev, data.get(NFTA_TARGET_INFO, b""))
                if ep:
                    out.endpoints.append(ep)
    return out


def map_endpoint(data: bytes, addr_off: int, port_off: int | None) -> str:
    """'IP:PORT' from one element's data of an anonymous DNAT map (ipv4_addr . inet_service)."""
    ip = str(ipaddress.IPv4Address(data[addr_off : addr_off + 4]))
    if port_off is None or len(data) < port_off + 2:
        return ip
    return f"{ip}:{struct.unpack_from('!H', data, port_off)[0]}"


# ---- netlink -----------------------------------------------------------------------------------


class Netlink:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nl.NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self.seq = itertools.count(1)

    def request(self, msg: int, family: str, flags: int, attrs: bytes) -> Iterator[bytes]:
        """Send one nftables request; yield each answer's payload (after nfgenmsg) until the
        ack or DONE. Raises OSError with the kernel's errno on a negative acknowledgement."""
        seq = next(self.seq)
        kind = (NFNL_SUBSYS_NFTABLES << 8) | msg
        flags |= nl.NLM_F_REQUEST
        self.sock.send(nl.nfnl_message(kind, flags, seq, FAMILIES[family], attrs))
        while True:
            for message in nl.messages(self.sock.recv(1 << 20)):
                if message.seq != seq:
                    continue
                if message.kind == nl.NLMSG_DONE:
                    return
                if message.kind == nl.NLMSG_ERROR:
                    if code := nl.error_of(message):
                        raise OSError(code, errno.errorcode.get(code, str(code)))
                    return
                yield message.body[nl.NFGEN.size :]

    def rules(self, family: str, table: str, chain: str) -> list[bytes]:
        """The rules of one chain (a dump the kernel filters by table and chain)."""
        attrs = _attr(NFTA_RULE_TABLE, table.encode() + b"\0")
        attrs += _attr(NFTA_RULE_CHAIN, chain.encode() + b"\0")
        try:
            return list(self.request(NFT_MSG_GETRULE, family, nl.NLM_F_DUMP, attrs))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return []
            raise

    def elements(
        self, family: str, table: str, set_name: str, extra: bytes = b"", flags: int = nl.NLM_F_DUMP
    ) -> Iterator[tuple[bytes, bytes | Verdict]]:
        """(key, data) of each element of a set or map (data b'' for sets)."""
        attrs = _attr(NFTA_SET_ELEM_LIST_TABLE, table.encode() + b"\0")
        attrs += _attr(NFTA_SET_ELEM_LIST_SET, set_name.encode() + b"\0") + extra
        for payload in self.request(NFT_MSG_GETSETELEM, family, flags, attrs):
            for kind, value in _attrs(payload):
                if kind != NFTA_SET_ELEM_LIST_ELEMENTS:
                    continue
                for _, elem in _attrs(value):
                    parts = dict(_attrs(elem))
                    key = decode_data(parts.get(NFTA_SET_ELEM_KEY, b""))
                    data = (
                        decode_data(parts[NFTA_SET_ELEM_DATA])
                        if NFTA_SET_ELEM_DATA in parts
                        else b""
                    )
                    yield (key if isinstance(key, bytes) else b""), data

    def count(self, family: str, table: str, set_name: str, port: int) -> int:
        suffix = vip_key("0.0.0.0", port)[4:]
        try:
            return sum(1 for key, _ in self.elements(family, table, set_name) if key[4:] == suffix)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return 0
            raise

    def dnat(self, family: str, table: str, chain: str) -> list[str]:
        """Every endpoint CHAIN can DNAT to, following jumps and anonymous maps."""
        found: set[str] = set()
        seen: set[str] = set()
        todo = [(chain, 0)]
        while todo:
            name, depth = todo.pop()
            if name in seen or depth > MAX_DEPTH:
                continue
            seen.add(name)
            for payload in self.rules(family, table, name):
                rule = summarize_rule(payload)
                found.update(rule.endpoints)
                todo += [(c, depth + 1) for c in rule.chains]
                for set_name, a_off, p_off in rule.dnat_maps:
                    for _, data in self._anonymous(family, table, set_name):
                        if isinstance(data, bytes):
                            found.add(map_endpoint(data, a_off, p_off))
                for set_name in rule.verdict_maps:
                    for _, data in self._anonymous(family, table, set_name):
                        if isinstance(data, Verdict) and data.chain:
                            todo.append((data.chain, depth + 1))
        return sorted(found)

    def _anonymous(
        self, family: str, table: str, set_name: str
    ) -> list[tuple[bytes, bytes | Verdict]]:
        try:
            return list(self.elements(family, table, set_name))
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # replaced by a newer transaction meanwhile
                return []
            raise

    def bucket(self, table: str, set_name: str, vip: str, port: int, bucket: int) -> str:
        """kpx's endpoints[VIP . tcp . PORT . bucket] as 'IP:PORT', or '-'."""
        key = vip_key(vip, port) + struct.pack("=I", bucket)  # numgen: host byte order
        elem = _attr(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, key), nested=True)
        extra = _attr(
            NFTA_SET_ELEM_LIST_ELEMENTS, _attr(NFTA_LIST_ELEM, elem, nested=True), nested=True
        )
        try:
            found = list(self.elements("ip", table, set_name, extra, nl.NLM_F_ACK))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return "-"
            raise
        if not found or not isinstance(found[0][1], bytes) or len(found[0][1]) < 6:
            return "-"
        return map_endpoint(found[0][1], 0, 4)


def answer(nl: Netlink, line: str) -> str:
    words = line.split()
    try:
        if words[:1] == ["count"] and len(words) == 5:
            return str(nl.count(words[1], words[2], words[3], int(words[4])))
        if words[:1] == ["rules"] and len(words) == 4:
            return str(len(nl.rules(words[1], words[2], words[3])))
        if words[:1] == ["dnat"] and len(words) == 4:
            return " ".join(nl.dnat(words[1], words[2], words[3])) or "-"
        if words[:1] == ["buckets"] and len(words) == 6:
            table, set_name, vip, port = words[1], words[2], words[3], int(words[4])
            return " ".join(nl.bucket(table, set_name, vip, port, b) for b in range(int(words[5])))
    except (OSError, ValueError, KeyError) as exc:
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
