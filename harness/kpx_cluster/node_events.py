"""What happened on each node while a migration ran under load, to explain a failed try.

A migration test's load records only (when, target, error, source port) for a try that failed;
by the time the test reads it, the rules that were in force are gone. `recording(topo, nodes)`
runs two listeners in every node's netns for the duration of the migration, stamping each line
with the wall clock as it arrives:

- ``nft monitor``: every ruleset change (kpx's tables, and iptables-nft's, which kube-proxy's
  iptables mode and the removal of its rules write);
- ``conntrack -E -e NEW``: every new connection the node's conntrack confirmed, with its reply
  tuple, which says where the node sent it: to a backend (DNAT), to itself (no DNAT: a
  NodePort then meets no socket and is refused) or nowhere (no NEW event: a rule dropped or
  rejected it before confirmation).

`explain(...)` (pure) picks, for each of the first failures, every node's ruleset changes from a
little before to a little after it, and its own connection's conntrack events (by its source
port). Listening costs the nodes nothing until something
changes; the harness reads a few hundred lines per second under the migrations' load.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from .netns import Node, Topology

#: The listeners of one node: (name, argv).
LISTENERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nft", ("nft", "monitor")),
    ("conntrack", ("conntrack", "-E", "-e", "NEW")),
)
#: Lines kept, of all nodes and listeners (the oldest are dropped beyond it; a migration test's
#: load makes about 600 a second).
KEEP = 500_000
#: How far before and after a failure its explanation reaches (s): rules a little before it,
#: the connection's own conntrack event around it.
RULES_BEFORE, RULES_AFTER = 3.0, 1.0
CONNS_BEFORE, CONNS_AFTER = 0.3, 1.0
#: ... and for a failure that names its source port: its SYN or datagram retried included.
CONNS_LATER = 10.0


@dataclass(frozen=True)
class Line:
    at: float  # wall clock, time.time()
    node: str
    source: str  # a LISTENERS name
    text: str


@dataclass
class NodeEvents:
    """The lines of every node's listeners, oldest first (the last KEEP)."""

    lines: deque[Line] = field(default_factory=lambda: deque(maxlen=KEEP))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, line: Line) -> None:
        with self.lock:
            self.lines.append(line)

    def snapshot(self) -> list[Line]:
        with self.lock:  # copying a deque that another thread appends to raises
            return list(self.lines)


def _read(stream: IO[str], node: str, source: str, events: NodeEvents) -> None:
    for text in stream:
        events.add(Line(time.time(), node, source, text.rstrip("\n")))


@contextlib.contextmanager
def recording(topo: Topology, nodes: Sequence[Node]) -> Iterator[NodeEvents]:
    """Listen on every node of `nodes` until the block ends."""
    events = NodeEvents()
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    try:
        for node, (source, argv) in _listeners(nodes):
            proc = topo.run(
                node,
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            procs.append(proc)
            assert proc.stdout is not None
            reader = threading.Thread(
                target=_read, args=(proc.stdout, node.name, source, events), daemon=True
            )
            reader.start()
            readers.append(reader)
        for proc, (node, (source, _)) in zip(procs, _listeners(nodes), strict=True):
            _wait_subscribed(proc, f"{node.name} {source}")
        yield events
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in readers:
            reader.join(timeout=5)


def _listeners(nodes: Sequence[Node]) -> list[tuple[Node, tuple[str, tuple[str, ...]]]]:
    return [(node, listener) for node in nodes for listener in LISTENERS]


#: /proc/net/netlink's protocol number of netfilter's netlink sockets (NETLINK_NETFILTER).
_NETLINK_NETFILTER = 12


def _subscribed(pid: int) -> bool:
    """Whether process `pid` holds a netfilter netlink socket subscribed to a group (the
    listener is listening: a change made from now on reaches it). /proc/PID/net/netlink lists
    the netlink sockets of the process's netns, with their inodes."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:[") : -1]
            for fd in os.listdir(f"/proc/{pid}/fd")
        }
        with open(f"/proc/{pid}/net/netlink") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return False
    return any(
        int(row[1]) == _NETLINK_NETFILTER and int(row[3], 16) != 0 and row[9] in inodes
        for row in rows
    )


def _wait_subscribed(proc: subprocess.Popen[str], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not _subscribed(proc.pid):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not listening after {timeout:.0f}s (exit {proc.poll()})")
        time.sleep(0.05)


def _target_host_port(target: str) -> tuple[str, str]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), port


_PORT = re.compile(r"\(port (\d+)\)")


def _is_connection_to(text: str, target: str, source_port: str | None) -> bool:
    """Whether a conntrack line's original direction goes to `target` (host:port), from
    `source_port` when known."""
    host, port = _target_host_port(target)
    fields = text.split("[UNREPLIED]")[0].split()
    return (
        f"dst={host}" in fields
        and f"dport={port}" in fields
        and (source_port is None or f"sport={source_port}" in fields)
    )


def explain(
    lines: Sequence[Line],
    failures: Sequence[tuple[float, str, str]],
    first: int = 3,
) -> list[str]:
    """Pure: for each of the `first` failures (wall clock, target, reason), the ruleset
    changes of every node from RULES_BEFORE before to RULES_AFTER after it, and its
    connection's conntrack events on every node: by the source port its reason names
    (``(port N)``, `migration_load.failure`) from CONNS_BEFORE before to CONNS_LATER after
    it, or without one every new connection to its target from CONNS_BEFORE before to
    CONNS_AFTER after it."""
    out: list[str] = []
    for at, target, reason in sorted(failures)[:first]:
        out.append(f"-- {_clock(at)} {target} {reason}: what the nodes did around it")
        port = _PORT.search(reason)
        source_port = port.group(1) if port else None
        conns_until = at + (CONNS_LATER if source_port else CONNS_AFTER)
        found = [
            line
            for line in lines
            if (line.source == "nft" and at - RULES_BEFORE <= line.at <= at + RULES_AFTER)
            or (
                line.source == "conntrack"
                and at - CONNS_BEFORE <= line.at <= conns_until
                and _is_connection_to(line.text, target, source_port)
            )
        ]
        if not found:
            out.append("   (no ruleset change on any node, no new connection to it seen)")
        for line in sorted(found, key=lambda item: item.at):
            out.append(
                f"   {_clock(line.at)} {line.at - at:+.3f}s {line.node} {line.source}: "
                f"{line.text[:300]}"
            )
    return out


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}"
