"""The nftables backend's only I/O: `nft` run with an argument list and a script on stdin,
element batches sent on an nf_tables netlink socket, and questions asked on one (the ruleset's
generation id, a digest of our table)."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ..base import BackendError
from ..kernel import nft_listing, nft_query
from ..kernel.nft_transaction import TableContents, Transaction
from ..kernel.tool_input import feed
from ..nf_generation import read as read_generation
from . import names as n
from .netlink_batch import (
    NFPROTO,
    Batch,
    Elements,
    batch_problem,
    encode_batches,
    parse_acks,
)
from .netlink_query import TableDigest, elements_request

NFT = "nft"


def run_script(parts: Iterable[str]) -> None:
    """Apply the concatenated `parts` as one atomic transaction (`nft -f -`).

    The parts are written to nft's stdin as they are produced, 64 KiB at a time
    (`kernel.tool_input`), so nft parses the start of a large transaction while the caller
    still renders the rest (two cores instead of one).
    nft commits only after reading end-of-file: if producing a part fails, nft is killed
    first, and nothing of the transaction reaches the kernel. Raises BackendError when nft
    rejects the transaction.
    """
    fed = feed([NFT, "-f", "-"], parts)
    if fed.status != 0 or not fed.whole:
        message = fed.message or "it stopped reading its input"
        raise BackendError(f"nft rejected the transaction (exit {fed.status}): {message}")


def check_script(parts: Iterable[str]) -> str | None:
    """Whether the kernel accepts the concatenated `parts` as one transaction, asked in nft's
    check mode (`nft --check`: the kernel validates the whole batch and applies nothing).
    None when it does, else nft's message."""
    proc = _run([NFT, "--check", "-f", "-"], "".join(parts))
    if proc.returncode == 0:
        return None
    return proc.stderr.strip()[:2000] or f"nft --check exited {proc.returncode}"


def present_families() -> set[int]:
    """The IP families (4, 6) whose table is in the kernel, asked over netlink: one chain of
    each (its nat-output chain, which every full sync makes), well under a millisecond at any
    size. (Any `nft list` command, even `list tables`, first loads every set element into
    nft's cache: 2 s of CPU at 10,000 Services; a check-mode `nft` run, which asks without
    listing, costs 30-40 ms, mostly nft's own start, on every full sync's critical path.)
    BackendError when nf_tables cannot be asked at all."""
    try:
        with contextlib.closing(nft_query.query_socket()) as sock:
            return {fam for fam in n.FAMILIES if _has_our_chain(sock, NFPROTO[fam])}
    except OSError as exc:
        raise BackendError(f"cannot ask nf_tables for our tables: {exc.strerror or exc}") from exc


def _has_our_chain(sock: socket.socket, proto: int) -> bool:
    try:
        nft_query.ask(sock, nft_listing.chain_request(proto, n.TABLE, n.NAT_OUTPUT))
    except nft_listing.NetlinkError:  # ENOENT: no such table or chain
        return False
    return True


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run nft to completion; BackendError when it cannot be run at all."""
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BackendError(f"cannot run {argv[0]}: {exc}") from exc


SO_SNDBUFFORCE = 32


def load_elements(elements: Elements) -> None:
    """Add the elements to existing sets and maps: in batches (kernel transactions, see
    `encode_batches`), each sent by a second thread while this one encodes the next (the
    kernel's work and Python's overlap on two cores). A refused batch applies nothing of
    itself and stops the load: BackendError names the first set the kernel refused, and the
    batches before it stay applied (this fills tables a full sync just created, so the next
    full sync, which finds them, replaces them whole)."""
    if not any(pairs for sets in elements.values() for pairs in sets.values()):
        return
    try:
        with _Sender() as sender:
            for batch in encode_batches(elements):
                if not sender.send(batch):
                    break
    except ValueError as exc:
        raise BackendError(f"cannot encode the element batch: {exc}") from None


class _Sender:
    """A thread sending batches on one nf_tables socket, in order; the first problem (a
    refused message, a socket error) stops it and is raised when the sender closes."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=4)
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="nft-netlink", daemon=True)

    def __enter__(self) -> _Sender:
        try:
            self._thread.start()
        except RuntimeError as exc:  # "can't start new thread": no pid left (pids.max)
            raise BackendError(f"netlink element batch: {exc}") from exc
        return self

    def send(self, batch: Batch) -> bool:
        """Queue a batch; False once the sender stopped on a problem."""
        if self._problem is None:
            self._queue.put(batch)
        return self._problem is None

    def __exit__(self, *exc: object) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._problem is not None and exc[0] is None:
            raise BackendError(self._problem)

    def _run(self) -> None:
        sock: socket.socket | None = None
        while (batch := self._queue.get()) is not None:
            if self._problem is not None:
                continue  # drained, not sent, until the producer stops
            try:
                sock = sock or nft_query.query_socket()
                acks = _exchange(sock, batch.data, len(batch.messages))
                self._problem = batch_problem(batch, acks)
            except OSError as exc:
                self._problem = f"netlink element batch: {exc.strerror or exc}"
        if sock is not None:
            sock.close()


def _exchange(sock: socket.socket, data: bytes, expected: int) -> dict[int, int]:
    """Send one batch; the error code the kernel acknowledged each message with, by seq."""
    acks: dict[int, int] = {}
    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, len(data) + (1 << 16))
    # The kernel runs the whole batch inside this call; its acks are queued by return.
    sock.sendto(data, (0, 0))
    sock.setblocking(False)
    try:
        with contextlib.suppress(BlockingIOError):  # all there was: batch_problem says
            while len(acks) < expected:
                acks.update(parse_acks(sock.recv(1 << 20)))
    finally:
        sock.setblocking(True)
    return acks


def our_tables() -> set[str]:
    """Which of our tables exist, as 'family name' strings, asked over netlink
    (`nft_query.tables_present`: no `nft list`, which loads the whole ruleset first)."""
    try:
        return nft_query.tables_named(f"{fam} {n.TABLE}" for fam in n.FAMILIES.values())
    except OSError as exc:
        raise BackendError(f"cannot ask nf_tables for our tables: {exc.strerror or exc}") from exc


def carries_owner_flag(listing: str) -> bool:
    """Whether `nft -t list table` output shows `flags owner` on the table (before its first
    chain, set or map)."""
    for line in listing.splitlines()[1:]:
        words = line.strip().replace(",", " ").split()
        if words[:1] in (["chain"], ["set"], ["map"], ["flowtable"], ["}"]):
            return False
        if words[:1] == ["flags"] and "owner" in words[1:]:
            return True
    return False


def owned_by_a_process(table: str) -> bool:
    """Whether the table ('family name') carries `flags owner`: it belongs to a running
    process's netlink socket, which alone may change it, and goes when that socket closes.
    kpx never makes such a table."""
    proc = _run([NFT, "-t", "list", "table", *table.split()])
    return proc.returncode == 0 and carries_owner_flag(proc.stdout)


def delete_tables(tables: set[str]) -> None:
    if tables:
        run_script([f"delete table {t}\n" for t in sorted(tables)])


def generation() -> int:
    """The ruleset's generation id (`backends.nf_generation`)."""
    return read_generation()


def table_digest(family: int, still: Callable[[], bool] | None = None) -> bytes:
    """A digest of our table of `family` (4, 6) as the kernel holds it: its sets, rules, and
    the elements of the sets the data path does not update (netlink_query.TableDigest). A
    table that cannot be dumped (absent) gives a digest of the error. With `still` (the
    ruleset still of the generation the read is for), the read stops with
    nft_query.Overtaken as soon as it is false, between any two reads of a dump: a digest
    that a commit overtook is of no use, and at 30,000 Services a whole read takes seconds."""
    digest = TableDigest()
    proto = NFPROTO[family]
    ask = nft_query.ask
    try:
        with contextlib.closing(nft_query.query_socket()) as sock:
            digest.add_section("sets")
            sets = list(ask(sock, nft_listing.sets_request(proto, n.TABLE), still))
            for message in sets:
                digest.add(message)
            digest.add_section("rules")
            for message in ask(sock, nft_listing.rules_request(proto, n.TABLE), still):
                digest.add(message)
            for name in sorted(nft_listing.set_names(sets)):
                if n.is_affinity_set(name):
                    continue  # the data path adds and expires these elements
                digest.add_section(name)
                for message in ask(sock, elements_request(proto, n.TABLE, name), still):
                    digest.add(message)
    except nft_listing.NetlinkError as exc:
        return f"error {exc.errno}".encode()
    return digest.digest()


def table_contents(family: int) -> TableContents | None:
    """The chains (with the comment of each of their rules), sets and maps of our table of
    `family` (4, 6), by name (`kernel.nft_query.table_contents`)."""
    return nft_query.table_contents(NFPROTO[family], n.TABLE)


class Kernel(Protocol):
    """Every nftables edge of the nftables backend, as one object: `NodeKernel` on a node,
    `fake.FakeNftables` in memory. Transactions arrive typed, as the backend builds them; the
    node's kernel renders them for nft, the fake applies them as they are."""

    def run(self, transactions: Iterable[Transaction]) -> None:
        """Apply the transactions as one atomic change; BackendError when refused."""

    def check(self, transactions: Iterable[Transaction]) -> str | None:
        """What the kernel would say about applying them (None: accepted), applying nothing."""

    def present_families(self) -> set[int]:
        """The families whose table is in the kernel."""

    def load_elements(self, elements: Elements) -> None:
        """Add elements to existing sets (netlink batches)."""

    def generation(self) -> int:
        """The ruleset's generation id."""

    def table_digest(self, family: int, still: Callable[[], bool] | None = None) -> bytes:
        """A digest of our table of `family` as the kernel holds it (nft_query.Overtaken as
        soon as `still`, asked as the read goes, is false)."""

    def table_contents(self, family: int) -> TableContents | None:
        """The names of what our table of `family` holds (None: not to be listed)."""


class NodeKernel:
    """The node's kernel: transactions rendered for `nft -f -` (streamed as they are rendered,
    so nft parses the start of a large change while the rest is rendered), elements and the
    drift check over netlink."""

    def run(self, transactions: Iterable[Transaction]) -> None:
        run_script(txn.render() for txn in transactions)

    def check(self, transactions: Iterable[Transaction]) -> str | None:
        return check_script(txn.render() for txn in transactions)

    def present_families(self) -> set[int]:
        return present_families()

    def load_elements(self, elements: Elements) -> None:
        load_elements(elements)

    def generation(self) -> int:
        return generation()

    def table_digest(self, family: int, still: Callable[[], bool] | None = None) -> bytes:
        return table_digest(family, still)

    def table_contents(self, family: int) -> TableContents | None:
        return table_contents(family)
