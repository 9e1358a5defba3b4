"""Set and map elements encoded as nf_tables netlink batches (pure: bytes in, bytes out).

A cold start loads 100,000+ elements. Through `nft -f`, nft spends about 1.5 s of CPU parsing
and evaluating their text; encoded here they cost about a tenth of that, and the kernel's work
is the same. Only elements go this way, into sets and maps an nft transaction created (so nft
still owns every definition, rule and type); one batch is one kernel transaction, and a
large load is cut into several, so the kernel commits one while the next is encoded.

Elements are typed values (`schema.Element`), encoded by the one declaration of their set
(`schema.declaration`): addresses by `inet_pton`, protocols from a fixed table, ports and
buckets as integers; a value of the wrong kind or out of range raises ValueError naming the
set and element. Chain names in verdicts must be plain names.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice

from ...model.types import Protocol
from ..kernel.netlink import (
    NETLINK_NETFILTER,
    NLA_F_NESTED,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_REQUEST,
    attr,
    nested,
    nfnl_message,
    parse_acks,
)
from . import names as n
from .schema import VERDICT_MAPS, Field, Goto, Key, Pair, ValueKind, declaration

__all__ = ["NETLINK_NETFILTER", "parse_acks"]

NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWSETELEM = 12
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_SET_ELEM_DATA = 2
NFTA_DATA_VALUE = 1
NFTA_DATA_VERDICT = 2
NFTA_VERDICT_CODE = 1
NFTA_VERDICT_CHAIN = 2
NFT_GOTO = -4
NFPROTO = {4: socket.AF_INET, 6: socket.AF_INET6}  # NFPROTO_IPV4/6 equal AF_INET/6

# An attribute's length is 16 bits: a message's element list stays well below 64 KiB.
MAX_ELEMENTS_BYTES = 48 * 1024
_PROTOCOLS = {Protocol.TCP: 6, Protocol.UDP: 17, Protocol.SCTP: 132}
_CHAIN_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")
ADDR, PROTO, PORT, BUCKET = Field.ADDR, Field.PROTO, Field.PORT, Field.BUCKET


def loadable(set_name: str) -> bool:
    """Whether this module can load the set's elements: exact-match sets and maps (not
    interval sets, nor the dynamic affinity sets)."""
    decl = declaration(set_name)
    return decl is not None and not decl.interval and not decl.dynamic_timeout


class _FieldEncoder:
    """Typed fields to register-sized bytes (each field padded to 4 bytes) for one family.
    Protocols, ports and buckets come from small caches; a VIP's `addr . proto . port`, which
    recurs in several sets and in each of its endpoint keys, is cached whole (see `cache`)."""

    def __init__(self, family: int) -> None:
        self.family = NFPROTO[family]  # the address family inet_pton takes
        self.small: dict[Field, dict[object, bytes]] = {PROTO: {}, PORT: {}, BUCKET: {}}
        self._caches: dict[tuple[Field, ...], dict[Key, bytes]] = {}

    def width(self, kinds: tuple[Field, ...]) -> int:
        return sum(16 if k == ADDR and self.family == socket.AF_INET6 else 4 for k in kinds)

    def cache(self, kinds: tuple[Field, ...]) -> dict[Key, bytes]:
        """Whole keys of this layout already converted (filled by the caller)."""
        return self._caches.setdefault(kinds, {})

    def fields(self, kinds: tuple[Field, ...], values: Key) -> bytes:
        """The bytes of `values`, one per kind; ValueError when malformed."""
        if type(values) is not tuple or len(values) != len(kinds):
            raise ValueError(f"expected {len(kinds)} fields")
        return b"".join([self.field(kind, v) for kind, v in zip(kinds, values, strict=True)])

    def field(self, kind: Field, value: object) -> bytes:
        if kind == ADDR:
            if not isinstance(value, str):
                raise ValueError(f"{value!r} is not an address")
            return socket.inet_pton(self.family, value)
        small = self.small[kind]
        got = small.get(value)
        if got is None:
            if kind == PROTO:
                if not isinstance(value, Protocol):
                    raise ValueError(f"{value!r} is not a protocol")
                got = bytes((_PROTOCOLS[value], 0, 0, 0))
            elif kind == PORT:
                got = struct.pack(">H2x", _bounded(value, 0xFFFF))
            elif kind == BUCKET:  # a numgen bucket: numgen writes its register in host order
                got = struct.pack("=I", _bounded(value, 0xFFFFFFFF))
            else:
                raise ValueError(f"{kind.value} fields cannot be loaded")
            small[value] = got
        return got


def _bounded(value: object, top: int) -> int:
    if type(value) is not int or not 0 <= value <= top:
        raise ValueError(f"{value!r} is not an integer in 0..{top}")
    return value


def _verdict(value: object) -> bytes:
    if not isinstance(value, Goto) or not _CHAIN_NAME.fullmatch(value.chain):
        raise ValueError("a verdict must be Goto(<chain>)")
    code = attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_GOTO))
    chain = value.chain.encode() + b"\0"
    return nested(NFTA_DATA_VERDICT, code + attr(NFTA_VERDICT_CHAIN, chain))


def _header(kind: int, payload_length: int) -> bytes:
    return struct.pack("=HH", 4 + payload_length, kind)


Pairs = Iterable[Pair]


def _element_encoder(enc: _FieldEncoder, set_name: str) -> Callable[[Pairs], list[bytes]]:
    """Encodes elements of `set_name`, each as an NFTA_LIST_ELEM attribute. Every field is a
    multiple of 4 bytes wide, so each layout's attribute headers are constants: an element
    is those headers around a few cached or directly converted fields. One loop per list of
    elements (a cold start encodes 100,000+ of them): no function call per element when its
    fields are cached."""
    decl = declaration(set_name)
    if decl is None or not loadable(set_name):
        raise ValueError(f"set {set_name}: its elements cannot be loaded over netlink")
    key_kinds = decl.key
    bucketed = key_kinds[-1] == BUCKET
    lead = key_kinds[:-1] if bucketed else key_kinds
    leads, buckets, ports = enc.cache(lead), enc.small[BUCKET], enc.small[PORT]
    key_width = enc.width(key_kinds)
    key_attr = _header(NFTA_SET_ELEM_KEY | NLA_F_NESTED, 4 + key_width)
    key_attr += _header(NFTA_DATA_VALUE, key_width)

    def head(value_length: int) -> bytes:
        body = len(key_attr) + key_width + value_length
        return _header(NFTA_LIST_ELEM | NLA_F_NESTED, body) + key_attr

    def lead_bytes(key: Key) -> bytes:
        got = leads[key] = enc.fields(lead, key)
        return got

    def fail(key: object, value: object, err: Exception) -> ValueError:
        shown = repr(key) if value is None else f"{key!r} : {value!r}"
        return ValueError(f"set {set_name}: element {shown}: {err}")

    if decl.value is ValueKind.NONE:
        set_head = head(0)

        def encode_set(pairs: Pairs) -> list[bytes]:
            out = []
            key: object = ()
            value: object = None
            try:
                for key, value in pairs:
                    if value is not None:
                        raise ValueError("a set element has no value")
                    out.append(set_head + (leads.get(key) or lead_bytes(key)))
            except (ValueError, OSError, TypeError) as err:
                raise fail(key, value, err) from None
            return out

        return encode_set

    if decl.value is ValueKind.VERDICT:
        verdicts: dict[object, tuple[bytes, bytes]] = {}

        def verdict(value: object) -> tuple[bytes, bytes]:
            data = _verdict(value)
            data = _header(NFTA_SET_ELEM_DATA | NLA_F_NESTED, len(data)) + data
            got = verdicts[value] = (head(len(data)), data)
            return got

        def encode_verdicts(pairs: Pairs) -> list[bytes]:
            out = []
            key: object = ()
            value: object = None
            try:
                for key, value in pairs:
                    vhead, data = verdicts.get(value) or verdict(value)
                    out.append(vhead + (leads.get(key) or lead_bytes(key)) + data)
            except (ValueError, OSError, TypeError) as err:
                raise fail(key, value, err) from None
            return out

        return encode_verdicts

    assert bucketed and decl.value is ValueKind.ENDPOINT, decl
    value_width = enc.width(decl.value_fields)
    value_attr = _header(NFTA_SET_ELEM_DATA | NLA_F_NESTED, 4 + value_width)
    value_attr += _header(NFTA_DATA_VALUE, value_width)
    endpoint_head = head(len(value_attr) + value_width)
    pton, af, field = socket.inet_pton, enc.family, enc.field

    def encode_endpoints(pairs: Pairs) -> list[bytes]:
        out = []
        key: object = ()
        value: object = None
        join = b"".join
        try:
            for key, value in pairs:
                if type(value) is not tuple or len(value) != 2:
                    raise ValueError("a map element needs an (address, port) value")
                front, bucket = key[:-1], key[-1]
                addr, port = value
                out.append(
                    join(
                        (
                            endpoint_head,
                            leads.get(front) or lead_bytes(front),
                            buckets.get(bucket) or field(BUCKET, bucket),
                            value_attr,
                            pton(af, addr),
                            ports.get(port) or field(PORT, port),
                        )
                    )
                )
        except (ValueError, OSError, TypeError) as err:
            raise fail(key, value, err) from None
        return out

    return encode_endpoints


@dataclass(frozen=True)
class Batch:
    """One kernel transaction: the bytes to send, and which set each message fills."""

    data: bytes
    messages: dict[int, tuple[int, str]]  # sequence number -> (family, set name)


Elements = Mapping[int, Mapping[str, Iterable[Pair]]]

BATCH_ELEMENTS = 5000


def encode_batches(elements: Elements, per_batch: int = BATCH_ELEMENTS) -> Iterator[Batch]:
    """The same elements in batches (kernel transactions) of about `per_batch` elements
    (0: one batch), encoded one at a time, so the kernel can commit one while the next is
    encoded. The dispatch (verdict) maps come last, in one batch of their own: a batch that
    adds verdicts makes the kernel validate the table's rules again, once per batch; and a
    Service is dispatched only once everything it dispatches to is in place."""
    encoders = {family: _FieldEncoder(family) for family in elements}
    batch = _BatchWriter()
    for verdicts in (False, True):
        for family, sets in elements.items():
            for set_name, pairs in sets.items():
                if (set_name in VERDICT_MAPS) != verdicts:
                    continue
                encode = _element_encoder(encoders[family], set_name)
                # Taken a step at a time: `pairs` may be made as they are consumed.
                step = per_batch if per_batch and not verdicts else sys.maxsize
                left = iter(pairs)
                while part := list(islice(left, step)):
                    for chunk in _chunks(encode(part)):
                        batch.add(family, set_name, chunk)
                    batch.elements += len(part)
                    if per_batch and not verdicts and batch.elements >= per_batch:
                        yield batch.close()
                        batch = _BatchWriter()
        if per_batch and batch.messages:
            yield batch.close()
            batch = _BatchWriter()
    if not per_batch or batch.messages:
        yield batch.close()


class _BatchWriter:
    """Messages of one batch as they are added."""

    KIND = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM
    FLAGS = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK

    def __init__(self) -> None:
        self.out = [
            nfnl_message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, 0, b"", NFNL_SUBSYS_NFTABLES)
        ]
        self.messages: dict[int, tuple[int, str]] = {}
        self.elements = 0

    def add(self, family: int, set_name: str, encoded: bytes) -> None:
        seq = len(self.messages) + 1
        self.messages[seq] = (family, set_name)
        head = attr(NFTA_SET_ELEM_LIST_TABLE, n.TABLE.encode() + b"\0")
        head += attr(NFTA_SET_ELEM_LIST_SET, set_name.encode() + b"\0")
        listed = nested(NFTA_SET_ELEM_LIST_ELEMENTS, encoded)
        self.out.append(nfnl_message(self.KIND, self.FLAGS, seq, NFPROTO[family], head + listed))

    def close(self) -> Batch:
        end = nfnl_message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 0, 0, b"", NFNL_SUBSYS_NFTABLES)
        return Batch(b"".join([*self.out, end]), self.messages)


def _chunks(elements: list[bytes]) -> Iterator[bytes]:
    """Encoded elements joined into runs of at most MAX_ELEMENTS_BYTES."""
    if not elements:
        return
    per_run = max(1, MAX_ELEMENTS_BYTES // max(map(len, elements)))
    for start in range(0, len(elements), per_run):
        yield b"".join(elements[start : start + per_run])


def batch_problem(batch: Batch, acks: Mapping[int, int]) -> str | None:
    """What went wrong with a sent batch, from the kernel's acknowledgements (None: every
    message was acknowledged without error, so the transaction committed)."""
    failed = sorted((seq, code) for seq, code in acks.items() if code)
    if failed:
        seq, code = failed[0]
        family, set_name = batch.messages.get(seq, (0, "?"))
        where = f"{n.FAMILIES.get(family, '?')} {n.TABLE} {set_name}"
        name = errno.errorcode.get(code, str(code))
        return (
            f"the kernel refused the element batch at {where}: {os.strerror(code)} ({name});"
            " none of it was applied"
        )
    if len(acks) < len(batch.messages):
        return f"the kernel acknowledged {len(acks)} of {len(batch.messages)} element messages"
    return None
