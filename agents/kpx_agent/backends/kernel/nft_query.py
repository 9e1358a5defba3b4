"""Asking nf_tables about one table over netlink (I/O; the questions and the reading of the
answers are `nft_listing`'s)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable, Iterable

from ..nf_generation import NETLINK_NETFILTER
from . import nft_listing as q
from .names import NFPROTO_OF
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


#: What the kernel answers for a table that is not there: no such table, or no nf_tables
#: support for its family at all (an IPv6 table where IPv6 is off).
_ABSENT = frozenset({errno.ENOENT, errno.EAFNOSUPPORT})


def tables_present(tables: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """Which of `tables` (family NFPROTO_*, name) are in the kernel: one netlink question each,
    answered with the table alone, whatever the ruleset holds. (`nft list tables` first loads
    every table's rules into nft's cache: 6.5 s with the iptables-nft nat table of 10,000
    Services and no commits; beside an agent syncing every second it ran for over a minute.)
    OSError when nf_tables cannot be asked."""
    found: set[tuple[int, str]] = set()
    with contextlib.closing(query_socket()) as sock:
        for family, name in tables:
            try:
                ask(sock, q.table_request(family, name))
            except q.NetlinkError as exc:
                if exc.errno in _ABSENT:
                    continue
                why = f"asking for table {name}: {os.strerror(exc.errno)}"
                raise OSError(exc.errno, why) from exc
            found.add((family, name))
    return found


def tables_named(tables: Iterable[str]) -> set[str]:
    """`tables_present` for tables spelled as nft spells them, 'family name' ("ip kpx")."""
    wanted: dict[tuple[int, str], str] = {}
    for spec in tables:
        family, _, name = spec.partition(" ")
        wanted[(NFPROTO_OF[family], name)] = spec
    present = tables_present(wanted)
    return {spec for key, spec in wanted.items() if key in present}


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
