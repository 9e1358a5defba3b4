"""The node simulator's one way into a network namespace: its file under /run/netns.

A pod's (or node's) network namespace is named by the Topology and bound at
``/run/netns/<name>``. Everything in the simulator enters it through that file:
- processes (the "process" runtime) through `Topology.run` (``ip netns exec <name>``: setns(2)
  on that file, then exec);
- runc containers through the OCI spec's network namespace `path` (runc does the setns);
- probes through `socket_in`, which creates a socket on a helper thread that enters the file
  with setns(2) for the duration of one socket() call (a socket stays in the netns it was
  created in).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def path(name: str) -> str:
    """The file that holds network namespace `name`."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a network namespace name: {name!r}")
    return f"{NETNS_RUN_DIR}/{name}"


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def socket_in(name: str, family: int) -> socket.socket:
    """A non-blocking TCP socket created in netns `name`. Blocking: call it on a thread of its
    own (it switches the calling thread's netns for the call)."""
    with open("/proc/thread-self/ns/net", "rb") as home, open(path(name), "rb") as target:
        _setns(target.fileno())
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        finally:
            try:
                _setns(home.fileno())
            except OSError:  # pragma: no cover - never seen; the thread would be unusable
                log.critical("cannot leave netns %s: probes are broken", name)
                raise
    sock.setblocking(False)
    return sock
