"""The ipvs backend's batched netlink requests: ack parsing, chunks, error reports (pure)."""

from __future__ import annotations

import errno
import struct

from kpx_agent.backends.ipvs.batch import Chunker, describe_errors, parse_acks


def ack(seq: int, code: int = 0) -> bytes:
    """An NLMSG_ERROR message (an ack when code is 0) with the request's header (capped)."""
    request_header = struct.pack("=IHHII", 40, 30, 5, seq, 0)
    body = struct.pack("=i", code) + request_header
    return struct.pack("=IHHII", 16 + len(body), 2, 0x100, seq, 1234) + body


def test_acks_and_errors_are_read_by_sequence_number() -> None:
    data = ack(1) + ack(2, -errno.EEXIST) + ack(3) + struct.pack("=IHHII", 20, 3, 0, 9, 0)
    data += b"\0\0\0\0"  # NLMSG_DONE with a payload: not an ack
    assert list(parse_acks(data)) == [(1, 0), (2, errno.EEXIST), (3, 0)]


def test_requests_are_cut_into_chunks_under_the_limit_in_order() -> None:
    queue = Chunker(limit=100)
    queue.pending = [(n, bytes(40), f"r{n}") for n in range(1, 6)]
    chunks = list(queue.chunks())
    assert [[seq for seq, _, _ in c] for c in chunks] == [[1, 2], [3, 4], [5]]
    assert queue.pending == []
    # At most max_requests per chunk (their acks must fit the receive buffer).
    queue = Chunker(limit=10_000, max_requests=2)
    queue.pending = [(n, bytes(40), f"r{n}") for n in range(1, 6)]
    assert [len(c) for c in queue.chunks()] == [2, 2, 1]
    # The queue is empty once the first chunk is taken: a chunk that failed to go out is not
    # sent again by the next flush.
    queue.pending = [(n, bytes(40), f"r{n}") for n in range(1, 6)]
    next(queue.chunks())
    assert queue.pending == []
    # A request larger than the limit goes alone, not dropped.
    queue.pending = [(7, bytes(300), "big")]
    assert [len(c) for c in queue.chunks()] == [1]


def test_every_failed_request_is_named() -> None:
    failed = [
        (f"add real server 10.0.0.{n}:80 of tcp 10.96.0.1:80", errno.EINVAL) for n in range(25)
    ]
    text = describe_errors(failed)
    assert text.startswith("25 IPVS request(s) failed: ")
    assert "add real server 10.0.0.0:80 of tcp 10.96.0.1:80: EINVAL (Invalid argument)" in text
    assert "10.0.0.19:80" in text and "10.0.0.20:80" not in text and "... and 5 more" in text
