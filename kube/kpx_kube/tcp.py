"""TCP keepalive with a bound, for connections to the apiserver.

A connection whose peer vanished (apiserver VM lost, NAT entry dropped) is otherwise kept for
the kernel's defaults: 2 h of idle before the first probe, and about 15 min of retransmissions
for data that is never acknowledged. Here: probes after 30 s of idle, every 10 s, 3 unanswered
ones close it; unacknowledged data closes it after 60 s (TCP_USER_TIMEOUT). client-go's dialer
probes after 30 s as well; its HTTP/2 pings, which this HTTP/1.1 client lacks, are replaced by
the watch's read-idle timeout (`client.Client.watch`).
"""

from __future__ import annotations

import socket
from typing import Any

KEEPIDLE = 30  # seconds of silence before the first probe
KEEPINTVL = 10  # seconds between probes
KEEPCNT = 3  # unanswered probes before the connection is dropped
USER_TIMEOUT_MS = (KEEPIDLE + KEEPINTVL * KEEPCNT) * 1000


def tune(sock: socket.socket) -> None:
    """Keepalive and the user timeout on a TCP socket (options missing on the OS are skipped)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = {
        "TCP_KEEPIDLE": KEEPIDLE,
        "TCP_KEEPINTVL": KEEPINTVL,
        "TCP_KEEPCNT": KEEPCNT,
        "TCP_USER_TIMEOUT": USER_TIMEOUT_MS,
    }
    for name, value in options.items():
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def socket_factory(addr_info: tuple[Any, ...]) -> socket.socket:
    """For aiohttp.TCPConnector(socket_factory=...): a tuned socket for each connection."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setblocking(False)
    tune(sock)
    return sock
