"""The kernel's nftables ruleset generation id, asked over netlink (NFT_MSG_GETGEN).

The kernel bumps it with every committed nftables transaction, anyone's: `nft`, a CNI plugin,
and iptables-nft (every `iptables-restore` of the nf_tables flavour is one). One small request,
one small answer, at any ruleset size: the backends' drift checks ask it first, and read their
rules back only when it moved. Shared by the nftables and iptables backends (the generation is
the kernel's, not a mode's); `request` and `parse` are pure, `read` is the I/O.
"""

from __future__ import annotations

import contextlib
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN = 15
NFT_MSG_GETGEN = 16
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NFTA_GEN_ID = 1
NLA_TYPE_MASK = 0x3FFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_NFGEN = struct.Struct("=BBH")  # nfgenmsg


class GenerationError(OSError):
    """The kernel refused the request (its errno), or answered something else."""


def request(seq: int = 1) -> bytes:
    """An NFT_MSG_GETGEN request (family AF_UNSPEC)."""
    body = _NFGEN.pack(0, 0, 0)
    kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
    return _HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST, seq, 0) + body


def parse(data: bytes) -> int:
    """The generation id in the kernel's answer; GenerationError for an error answer."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            break
        body = data[offset + _HEADER.size : offset + length]
        if kind == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", body, 0)
            if error:
                raise GenerationError(-error, "the kernel refused NFT_MSG_GETGEN")
        elif kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
            attrs = body[_NFGEN.size :]
            at = 0
            while at + 4 <= len(attrs):
                size, attr = struct.unpack_from("=HH", attrs, at)
                if size < 4:
                    break
                if attr & NLA_TYPE_MASK == NFTA_GEN_ID:
                    return int(struct.unpack_from(">I", attrs, at + 4)[0])
                at += (size + 3) & ~3
        offset += (length + 3) & ~3
    raise GenerationError(0, "no generation id in the kernel's answer")


def read() -> int:
    """The ruleset's generation id now. OSError when the kernel cannot be asked (no nf_tables,
    no CAP_NET_ADMIN)."""
    with contextlib.closing(
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    ) as sock:
        sock.bind((0, 0))
        sock.sendto(request(), (0, 0))
        return parse(sock.recv(1 << 16))
