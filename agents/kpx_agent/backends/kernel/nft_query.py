"""Asking nf_tables about one table over netlink (I/O; the questions and the reading of the
answers are `nft_listing`'s)."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable

from ..nf_generation import NETLINK_NETFILTER
from . import nft_listing as q
from .nft_transaction import TableContents

log = logging.getLogger(__name__)

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # acknowledgements without a copy of the request
SO_RCVBUFFORCE = 33


def query_socket() -> socket.socket:
    """An nf_tables netlink socket for questions (a 4 MiB receive buffer for dumps)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 22)
        sock.bind((0, 0))
    except OSError:
        sock.close()
        raise
    return sock


class Overtaken(Exception):
    """A read stopped because what it reads changed meanwhile (its `still` turned false)."""


def ask(
    sock: socket.socket, request: bytes, still: Callable[[], bool] | None = None
) -> list[q.Message]:
    """Send one request; every message of its answer (a dump's up to its end). Raises
    NetlinkError when the kernel refused it. With `still`, asked before each read of the
    answer (up to 1 MiB of a dump at a time): Overtaken once it is false, the rest of the
    answer left unread (closing the socket drops it)."""
    sock.sendto(request, (0, 0))
    answer: list[q.Message] = []
    while True:
        if still is not None and not still():
            raise Overtaken()
        for message in q.messages(sock.recv(1 << 20)):
            q.check(message)
            if q.is_done(message) or message.kind == q.NLMSG_ERROR:
                return answer
            answer.append(message)
            if not message.flags & q.NLM_F_MULTI:
                return answer


def table_contents(family: int, table: str) -> TableContents | None:
    """The chains (with the comment of each of their rules), sets and maps of `table`
    (family: NFPROTO_IPV4/6), by name, from netlink dumps without elements (1 ms at 10,000
    Services). None when it cannot be listed (absent, refused) or holds a name that is not
    one of ours in form."""
    try:
        with contextlib.closing(query_socket()) as sock:
            chains = ask(sock, q.chains_request(family, table))
            rules = ask(sock, q.rules_request(family, table))
            sets = ask(sock, q.sets_request(family, table))
        return q.contents(chains, rules, sets, table)
    except (OSError, ValueError, q.NetlinkError) as exc:  # (ValueError: an answer misread)
        log.debug("cannot list table %s (family %d): %s", table, family, exc)
        return None
