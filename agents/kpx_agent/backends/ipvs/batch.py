"""Many IPVS requests per netlink round trip: queue encoded requests, send them in chunks, then
read one ack per request and report every failed one by the object it named.

One request per round trip (pyroute2's `IPVS.service`/`IPVS.dest` wait for each answer) made a
cold sync of 1,000 Services (11,000 virtual and real servers) take 107 s in the emulated guest.
The kernel handles the requests of one send in order (netlink_rcv_skb walks the buffer), so a
virtual server added earlier in a chunk is there for its real servers later in it; a request
that fails does not stop the ones after it, and each is acked (NLM_F_ACK) with its sequence
number, by which its error is reported.

The framing is the toolkit's (`kernel.netlink`: acks as positive errno), the chunking pure
(Chunker); RawNetlink is the thin socket edge.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..kernel.netlink import NETLINK_GENERIC, NETLINK_ROUTE, parse_acks

__all__ = ["NETLINK_ROUTE", "parse_acks"]

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # acks of failed requests without a copy of the request
SO_RCVBUFFORCE = 33
#: Bytes and requests per send: well under the socket's send buffer, and the acks of one chunk
#: well under its receive buffer (each ack is a small skb whose true size is about 1 KiB: at
#: 300 acks in a 208 KiB buffer the kernel drops acks and the socket reports ENOBUFS).
CHUNK_BYTES = 32 * 1024
CHUNK_REQUESTS = 128
RECEIVE_BUFFER = 1 << 20
#: Seconds to wait for the acks of a chunk (the kernel acks at once; missing acks: an error).
ACK_TIMEOUT = 30.0


def describe_errors(failed: list[tuple[object, int]], limit: int = 20) -> str:
    """One line per failed request (the object it named and the errno), the first `limit`."""
    lines = [
        f"{what}: {errno.errorcode.get(code, str(code))} ({os.strerror(code)})"
        for what, code in failed[:limit]
    ]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more")
    return f"{len(failed)} IPVS request(s) failed: " + "; ".join(lines)


@dataclass
class Chunker:
    """Queued requests: (sequence number, encoded message, what it does: str() says it), cut
    into chunks."""

    limit: int = CHUNK_BYTES
    max_requests: int = CHUNK_REQUESTS
    pending: list[tuple[int, bytes, object]] = field(default_factory=list)

    def chunks(self) -> Iterator[list[tuple[int, bytes, object]]]:
        """The queued requests in chunks; the queue is empty from the first one on (a chunk
        that fails to go out is not sent again by a later flush)."""
        pending, self.pending = self.pending, []
        chunk: list[tuple[int, bytes, object]] = []
        size = 0
        for item in pending:
            if chunk and (size + len(item[1]) > self.limit or len(chunk) >= self.max_requests):
                yield chunk
                chunk, size = [], 0
            chunk.append(item)
            size += len(item[1])
        if chunk:
            yield chunk


class RawNetlink:
    """A netlink socket (generic, or NETLINK_ROUTE): a chunk of requests out, their acks in."""

    def __init__(self, protocol: int = NETLINK_GENERIC) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
        self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        try:  # past net.core.rmem_max (needs CAP_NET_ADMIN, which the agent has)
            self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self._sock.bind((0, 0))
        self._sock.settimeout(ACK_TIMEOUT)

    def close(self) -> None:
        self._sock.close()

    def exchange(self, chunk: list[tuple[int, bytes, object]]) -> list[tuple[object, int]]:
        """Send the chunk in one write; the (what, errno) of each request that failed."""
        self._sock.sendto(b"".join(message for _, message, _ in chunk), (0, 0))
        waiting = {seq: what for seq, _, what in chunk}
        failed = []
        while waiting:
            try:
                data = self._sock.recv(1 << 17)
            except TimeoutError as exc:
                raise OSError(
                    f"no ack for {len(waiting)} IPVS request(s), e.g. "
                    f"{next(iter(waiting.values()))}"
                ) from exc
            for seq, code in parse_acks(data):
                what = waiting.pop(seq, None)
                if what is not None and code:
                    failed.append((what, code))
        return failed
