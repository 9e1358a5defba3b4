"""Questions to nf_tables over netlink about one table, and reading their answers (pure: bytes
in, bytes out), for every mode that owns an nftables table (nftables, ipvs's helper table).

`contents`: the table's chains (with the comment of each of their rules), sets and maps, by
name, from three dumps without elements (NFT_MSG_GETCHAIN, GETRULE, GETSET), which a full
sync reads before it swaps the table's contents in place (`nft_transaction.RedefineTable`).
The nftables mode's drift check builds on the same requests (`nftables.netlink_query`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..nf_generation import NFNL_SUBSYS_NFTABLES
from .netlink import (
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
from .nft_transaction import TableContents

__all__ = ["NLMSG_ERROR", "NLM_F_MULTI", "Message", "messages"]

NFT_MSG_GETTABLE = 1
NFT_MSG_NEWCHAIN = 3
NFT_MSG_GETCHAIN = 4
NFT_MSG_NEWRULE = 6
NFT_MSG_GETRULE = 7
NFT_MSG_NEWSET = 9
NFT_MSG_GETSET = 10
NFTA_TABLE_NAME = 1
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

# The names a listing may hand to nft: kpx's are all of this form; any other name (someone
# else's object in our table) makes a full sync replace the table whole instead.
PLAIN_NAME = re.compile(r"[a-z][a-z0-9-]{0,127}")


def message_type(msg: int) -> int:
    """The netlink message type of nf_tables message `msg`."""
    return (NFNL_SUBSYS_NFTABLES << 8) | msg


def string(attribute: int, text: str) -> bytes:
    return attr(attribute, text.encode() + b"\0")


def dump_request(msg: int, family: int, table_attribute: int, table: str, seq: int = 1) -> bytes:
    """Dump the objects of kind `msg` of `table` (family: NFPROTO_IPV4/6)."""
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(message_type(msg), flags, seq, family, string(table_attribute, table))


def chains_request(family: int, table: str, seq: int = 1) -> bytes:
    """Dump the chains of `table` (a kernel may answer with every chain of the family:
    `chain_names` keeps the table's)."""
    return dump_request(NFT_MSG_GETCHAIN, family, NFTA_CHAIN_TABLE, table, seq)


def table_request(family: int, table: str, seq: int = 1) -> bytes:
    """Ask for one table (not a dump): the answer is the table alone (no chain, rule or
    element), or ENOENT when it is not there."""
    name = string(NFTA_TABLE_NAME, table)
    return nfnl_message(message_type(NFT_MSG_GETTABLE), NLM_F_REQUEST, seq, family, name)


def chain_request(family: int, table: str, chain: str, seq: int = 1) -> bytes:
    """Ask for one chain of `table` (not a dump): the answer is the chain, or ENOENT when the
    table or the chain is not there."""
    names = string(NFTA_CHAIN_TABLE, table) + string(NFTA_CHAIN_NAME, chain)
    return nfnl_message(message_type(NFT_MSG_GETCHAIN), NLM_F_REQUEST, seq, family, names)


def rules_request(family: int, table: str, seq: int = 1) -> bytes:
    """Dump every rule of `table`."""
    return dump_request(NFT_MSG_GETRULE, family, NFTA_RULE_TABLE, table, seq)


def sets_request(family: int, table: str, seq: int = 1) -> bytes:
    return dump_request(NFT_MSG_GETSET, family, NFTA_SET_TABLE, table, seq)


class NetlinkError(Exception):
    """The kernel answered a request with an error (`errno`, positive)."""

    def __init__(self, errno: int) -> None:
        super().__init__(errno)
        self.errno = errno


def check(message: Message) -> None:
    """Raise NetlinkError for an error answer (an acknowledgement with errno 0 passes)."""
    if message.kind == NLMSG_ERROR and (error := error_of(message)):
        raise NetlinkError(error)


def is_done(message: Message) -> bool:
    return message.kind == NLMSG_DONE


def set_names(answer: Iterable[Message]) -> list[str]:
    """The set names in a dump of sets."""
    return [name for name, _ in set_kinds(answer)]


def chain_names(answer: Iterable[Message], table: str) -> list[str]:
    """The names of `table`'s chains in a dump of chains."""
    names = []
    for message in answer:
        if message.kind != message_type(NFT_MSG_NEWCHAIN):
            continue
        found = dict(attributes(message.body[4:]))
        if _text(found.get(NFTA_CHAIN_TABLE)) == table and NFTA_CHAIN_NAME in found:
            names.append(_text(found[NFTA_CHAIN_NAME]))
    return names


def set_kinds(answer: Iterable[Message]) -> list[tuple[str, bool]]:
    """(name, whether it is a map) of each set in a dump of sets."""
    kinds = []
    for message in answer:
        if message.kind != message_type(NFT_MSG_NEWSET):
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
        if message.kind != message_type(NFT_MSG_NEWRULE):
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


def contents(
    chains: Iterable[Message], rules: Iterable[Message], sets: Iterable[Message], table: str
) -> TableContents | None:
    """The contents of `table` from its dumps of chains, rules and sets; None when it holds
    a name that is not one of ours in form."""
    chain_list = chain_names(chains, table)
    comments = rule_comments(rules)
    kinds = set_kinds(sets)
    if not all(PLAIN_NAME.fullmatch(name) for name in [*chain_list, *(n for n, _ in kinds)]):
        return None
    return TableContents(
        chains={name: tuple(comments.get(name, ())) for name in chain_list},
        sets=tuple(name for name, is_map in kinds if not is_map),
        maps=tuple(name for name, is_map in kinds if is_map),
    )
