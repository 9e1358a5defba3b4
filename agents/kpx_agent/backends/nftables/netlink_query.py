"""Questions to nf_tables over netlink, and reading their answers (pure: bytes in, bytes out).

It backs the backend's drift check (`backend.NftablesBackend.drifted`), once the ruleset's
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

NFT_MSG_NEWRULE = 6
NFT_MSG_GETRULE = 7
NFT_MSG_NEWSET = 9
NFT_MSG_GETSET = 10
NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_RULE_TABLE = 1
NFTA_SET_TABLE = 1
NFTA_SET_NAME = 2
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3


def _kind(msg: int) -> int:
    return (NFNL_SUBSYS_NFTABLES << 8) | msg


def _string(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


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
