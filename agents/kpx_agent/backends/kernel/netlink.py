"""Netlink framing, once for every kernel edge (nf_tables element batches and queries, IPVS
generic netlink, ctnetlink): the message header, attributes, the walk over a receive buffer
and acknowledgements. Pure: bytes in, bytes out.

One convention for errors: an acknowledgement's error is a positive errno (0: success), as
`os.strerror` and `errno.errorcode` take it; the kernel sends it negated.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_ROUTE, NETLINK_NETFILTER, NETLINK_GENERIC = 0, 12, 16
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_ROOT = 0x100
NLM_F_MATCH = 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH
NLM_F_CREATE = 0x400
NLA_F_NESTED = 0x8000
NLA_F_NET_BYTEORDER = 0x4000
NLA_TYPE_MASK = ~(NLA_F_NESTED | NLA_F_NET_BYTEORDER) & 0xFFFF

HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, port id
ATTR = struct.Struct("=HH")  # nlattr: length, type
NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian)
_ERRNO = struct.Struct("=i")


class WireError(ValueError):
    """Bytes that are not the netlink the caller expects: says where and what."""


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    length = 4 + len(payload)
    return ATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def nested(kind: int, payload: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, payload)


def message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    """One netlink message: header and body."""
    return HEADER.pack(HEADER.size + len(body), kind, flags, seq, 0) + body


def nfnl_message(
    kind: int, flags: int, seq: int, family: int, payload: bytes, res_id: int = 0
) -> bytes:
    """One nfnetlink message: `kind` is (subsystem << 8) | message, `family` an NFPROTO/AF."""
    return message(kind, flags, seq, NFGEN.pack(family, 0, socket.htons(res_id)) + payload)


@dataclass(frozen=True, slots=True)
class Message:
    kind: int
    flags: int
    seq: int
    body: bytes
    offset: int  # where the message starts in the buffer


def messages(data: bytes) -> Iterator[Message]:
    """The messages of a receive buffer; WireError when a header or length does not fit."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            raise WireError(
                f"netlink message at byte {offset}: {len(data) - offset} bytes,"
                f" shorter than its {HEADER.size}-byte header"
            )
        length, kind, flags, seq, _port = HEADER.unpack_from(data, offset)
        if length < HEADER.size or offset + length > len(data):
            raise WireError(
                f"netlink message at byte {offset}: length {length} does not fit"
                f" the {len(data) - offset} bytes left"
            )
        yield Message(kind, flags, seq, data[offset + HEADER.size : offset + length], offset)
        offset += (length + 3) & ~3


def error_of(msg: Message, what: str = "error answer") -> int:
    """The positive errno of an NLMSG_ERROR (or a dump's NLMSG_DONE) message (0: success)."""
    if len(msg.body) < _ERRNO.size:
        raise WireError(f"{what} at byte {msg.offset}: {len(msg.body)} bytes, no error code")
    (error,) = _ERRNO.unpack_from(msg.body, 0)
    return -error


def parse_acks(data: bytes) -> Iterator[tuple[int, int]]:
    """(sequence number, errno) of each acknowledgement in a receive buffer (0: success),
    skipping other messages; a truncated tail ends the walk (the acks before it count)."""
    offset = 0
    while offset + HEADER.size <= len(data):
        length, kind, _flags, seq, _pid = HEADER.unpack_from(data, offset)
        if length < HEADER.size:
            break
        if kind == NLMSG_ERROR and offset + HEADER.size + _ERRNO.size <= len(data):
            (code,) = _ERRNO.unpack_from(data, offset + HEADER.size)
            yield seq, -code
        offset += (length + 3) & ~3


Span = tuple[int, int]  # an attribute's payload: data[start:end]


def attribute_spans(data: bytes, span: Span, where: str, part: str = "") -> dict[int, Span]:
    """The attributes in data[span] by type (without flags): where each one's payload is.
    Offsets, not copies: a dump holds many entries, each with a dozen attributes. Errors name
    `where` + `part` (joined only then: this runs a few times per entry)."""
    found: dict[int, Span] = {}
    at, end = span
    while at < end:
        if end - at < 4:
            raise WireError(f"{where}{part}: {end - at} stray bytes after the attributes")
        length, kind = ATTR.unpack_from(data, at)
        if length < 4 or at + length > end:
            raise WireError(
                f"{where}{part}: attribute {kind & NLA_TYPE_MASK} says length"
                f" {length}, {end - at} bytes left"
            )
        found[kind & NLA_TYPE_MASK] = (at + 4, at + length)
        at += (length + 3) & ~3
    return found


def attributes(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type without flags, payload) of each attribute in `data` (copies: for the few
    attributes of a query's answer; `attribute_spans` for a dump of many entries)."""
    offset = 0
    while offset + ATTR.size <= len(data):
        length, kind = ATTR.unpack_from(data, offset)
        if length < ATTR.size:
            raise WireError(f"bad attribute length {length} at {offset}")
        yield kind & NLA_TYPE_MASK, data[offset + ATTR.size : offset + length]
        offset += (length + 3) & ~3
