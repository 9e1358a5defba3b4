"""Questions to nf_tables over netlink, and reading their answers (pure: bytes in, bytes out).

It backs the listing of one table before a full sync swaps its contents in place (its chains
and how many rules each holds, its sets and maps: NFT_MSG_GETCHAIN, GETRULE and GETSET dumps,
no elements), and the backend's drift check (`backend.NftablesBackend.drifted`), once the ruleset's
generation id (`backends.nf_generation`) moved: a digest of one table as the kernel dumps it,
its sets (definitions), its rules, and the elements of its sets (NFT_MSG_GETSET, GETRULE,
GETSETELEM dumps), leaving out the sets the data path itself updates (session affinity: their
elements come and go with traffic). What is hashed is each answer's payload after its headers
(the netlink header carries the socket's port id, the nfgenmsg header the generation), and for
elements the element attributes only, in the order dumped, so where the kernel cut the dump
into messages does not matter. Another writer's commit elsewhere does not change it; a deleted
or added element, a flushed chain, a rule added to one of our chains does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..kernel.netlink import (
    NLM_F_DUMP,
    NLM_F_MULTI,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    Message,
    attr,
    attributes,
    error_of,
    messages,
    nfnl_message,
)
from .netlink_batch import NFNL_SUBSYS_NFTABLES

__all__ = ["NLMSG_ERROR", "NLM_F_MULTI", "Message", "messages"]

NFT_MSG_NEWCHAIN = 3
NFT_MSG_GETCHAIN = 4
NFT_MSG_NEWRULE = 6
NFT_MSG_GETRULE = 7
NFT_MSG_NEWSET = 9
NFT_MSG_GETSET = 10
NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_CHAIN_TABLE = 1
NFTA_CHAIN_NAME = 3
NFTA_RULE_TABLE = 1
NFTA_RULE_CHAIN = 2
NFTA_RULE_USERDATA = 7
NFTNL_UDATA_RULE_COMMENT = 0
NFTA_SET_TABLE = 1
NFTA_SET_NAME = 2
NFTA_SET_FLAGS = 3
NFT_SET_MAP = 0x8
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3


def _kind(msg: int) -> int:
    return (NFNL_SUBSYS_NFTABLES << 8) | msg


def _string(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


def chains_request(family: int, table: str, seq: int = 1) -> bytes:
    """Dump the chains of `table` (a kernel may answer with every chain of the family:
    `chain_names` keeps the table's)."""
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(
        _kind(NFT_MSG_GETCHAIN), flags, seq, family, _string(NFTA_CHAIN_TABLE, table)
    )


def rules_request(family: int, table: str, seq: int = 1) -> bytes:
    """Dump every rule of `table` (family: NFPROTO_IPV4/6)."""
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(_kind(NFT_MSG_GETRULE), flags, seq, family, _string(NFTA_RULE_TABLE, table))


def sets_request(family: int, table: str, seq: int = 1) -> bytes:
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(_kind(NFT_MSG_GETSET), flags, seq, family, _string(NFTA_SET_TABLE, table))


def elements_request(family: int, table: str, set_name: str, seq: int = 1) -> bytes:
    payload = _string(NFTA_SET_ELEM_LIST_TABLE, table) + _string(NFTA_SET_ELEM_LIST_SET, set_name)
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(_kind(NFT_MSG_GETSETELEM), flags, seq, family, payload)


class NetlinkError(Exception):
    """The kernel answered a request with an error (`errno`, positive)."""

    def __init__(self, errno: int) -> None:
        super().__init__(errno)
        self.errno = errno


def check(message: Message) -> None:
    """Raise NetlinkError for an error answer (an acknowledgement with errno 0 passes)."""
    if message.kind == NLMSG_ERROR and (error := error_of(message)):
        raise NetlinkError(error)


def set_names(answer: Iterable[Message]) -> list[str]:
    """The set names in a dump of sets."""
    names = []
    for message in answer:
        if message.kind == _kind(NFT_MSG_NEWSET):
            for kind, payload in attributes(message.body[4:]):
                if kind == NFTA_SET_NAME:
                    names.append(payload.rstrip(b"\0").decode())
    return names


def chain_names(answer: Iterable[Message], table: str) -> list[str]:
    """The names of `table`'s chains in a dump of chains."""
    names = []
    for message in answer:
        if message.kind != _kind(NFT_MSG_NEWCHAIN):
            continue
        found = dict(attributes(message.body[4:]))
        if _text(found.get(NFTA_CHAIN_TABLE)) == table and NFTA_CHAIN_NAME in found:
            names.append(_text(found[NFTA_CHAIN_NAME]))
    return names


def set_kinds(answer: Iterable[Message]) -> list[tuple[str, bool]]:
    """(name, whether it is a map) of each set in a dump of sets."""
    kinds = []
    for message in answer:
        if message.kind != _kind(NFT_MSG_NEWSET):
            continue
        found = dict(attributes(message.body[4:]))
        if NFTA_SET_NAME in found:
            flags = int.from_bytes(found.get(NFTA_SET_FLAGS, b"")[:4].rjust(4, b"\0"), "big")
            kinds.append((_text(found[NFTA_SET_NAME]), bool(flags & NFT_SET_MAP)))
    return kinds


def rule_comments(answer: Iterable[Message]) -> dict[str, list[str]]:
    """The comment of each rule ("" for none), by chain, in a dump of one table's rules."""
    comments: dict[str, list[str]] = {}
    for message in answer:
        if message.kind != _kind(NFT_MSG_NEWRULE):
            continue
        found = dict(attributes(message.body[4:]))
        chain = _text(found.get(NFTA_RULE_CHAIN))
        comments.setdefault(chain, []).append(comment_of(found.get(NFTA_RULE_USERDATA, b"")))
    return comments


def comment_of(userdata: bytes) -> str:
    """The comment in a rule's user data (libnftnl's TLVs: type, length, value), "" if none."""
    at = 0
    while at + 2 <= len(userdata):
        kind, length = userdata[at], userdata[at + 1]
        if kind == NFTNL_UDATA_RULE_COMMENT:
            return _text(userdata[at + 2 : at + 2 + length])
        at += 2 + length
    return ""


def _text(payload: bytes | None) -> str:
    return "" if payload is None else payload.rstrip(b"\0").decode(errors="replace")


class TableDigest:
    """A running hash of dumped answers (see the module docstring)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add_section(self, name: str) -> None:
        """Separate one dump from the next (a set's elements from another's)."""
        self._hash.update(b"\0" + name.encode() + b"\0")

    def add(self, message: Message) -> None:
        if message.kind == _kind(NFT_MSG_NEWSETELEM):
            for kind, payload in attributes(message.body[4:]):
                if kind == NFTA_SET_ELEM_LIST_ELEMENTS:
                    self._hash.update(payload)
        elif message.kind in (_kind(NFT_MSG_NEWRULE), _kind(NFT_MSG_NEWSET)):
            self._hash.update(message.body[4:])

    def digest(self) -> bytes:
        return self._hash.digest()


def is_done(message: Message) -> bool:
    return message.kind == NLMSG_DONE
