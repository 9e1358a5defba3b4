"""The nftables mode's drift check over netlink (pure: bytes in, bytes out).

It backs `backend.NftablesBackend.drifted`, once the ruleset's generation id
(`backends.nf_generation`) moved: a digest of one table as the kernel dumps it, its sets
(definitions), its rules, and the elements of its sets (NFT_MSG_GETSET, GETRULE, GETSETELEM
dumps; the requests and their answers in `kernel.nft_listing`), leaving out the sets the data
path itself updates (session affinity: their elements, and the element count a set's
definition carries on newer kernels, come and go with traffic). What is
hashed is each answer's payload after its headers (the netlink header carries the socket's
port id, the nfgenmsg header the generation), and for elements the element attributes only, in
the order dumped, so where the kernel cut the dump into messages does not matter. Another
writer's commit elsewhere does not change it; a deleted or added element, a flushed chain, a
rule added to one of our chains does.
"""

from __future__ import annotations

import hashlib

from ..kernel.netlink import NLM_F_DUMP, NLM_F_REQUEST, Message, attributes, nfnl_message
from ..kernel.nft_listing import NFT_MSG_NEWRULE, NFT_MSG_NEWSET, message_type, string

NFT_MSG_NEWSETELEM = 12
NFT_MSG_GETSETELEM = 13
NFTA_SET_ELEM_LIST_TABLE = 1
NFTA_SET_ELEM_LIST_SET = 2
NFTA_SET_ELEM_LIST_ELEMENTS = 3
#: a set's element count in its definition (recent kernels; 6.18 here): left out of the digest, as
#: the data path moves it in the affinity sets (the elements themselves are hashed apart)
NFTA_SET_COUNT = 20


def elements_request(family: int, table: str, set_name: str, seq: int = 1) -> bytes:
    payload = string(NFTA_SET_ELEM_LIST_TABLE, table) + string(NFTA_SET_ELEM_LIST_SET, set_name)
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return nfnl_message(message_type(NFT_MSG_GETSETELEM), flags, seq, family, payload)


class TableDigest:
    """A running hash of dumped answers (see the module docstring)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add_section(self, name: str) -> None:
        """Separate one dump from the next (a set's elements from another's)."""
        self._hash.update(b"\0" + name.encode() + b"\0")

    def add(self, message: Message) -> None:
        if message.kind == message_type(NFT_MSG_NEWSETELEM):
            for kind, payload in attributes(message.body[4:]):
                if kind == NFTA_SET_ELEM_LIST_ELEMENTS:
                    self._hash.update(payload)
        elif message.kind == message_type(NFT_MSG_NEWSET):
            for kind, payload in attributes(message.body[4:]):
                if kind != NFTA_SET_COUNT:
                    self._hash.update(kind.to_bytes(2, "big") + len(payload).to_bytes(4, "big"))
                    self._hash.update(payload)
        elif message.kind == message_type(NFT_MSG_NEWRULE):
            self._hash.update(message.body[4:])

    def digest(self) -> bytes:
        return self._hash.digest()
