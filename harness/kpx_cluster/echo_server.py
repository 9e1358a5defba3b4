"""A tiny backend for datapath tests: it answers with its name and the client address it saw.

    python -m kpx_cluster.echo_server --name NAME --port P [--port P2 ...] [--tcp] [--udp]
                                      [--bind ADDR ...]

TCP: for each connection, writes one line ``NAME <client_ip>\\n`` and closes (it never reads).
UDP: for each datagram, sends the same line back to the sender, from the address the datagram
was sent to (IP_PKTINFO), so replies stay correct in a netns with several addresses.
Default: both TCP and UDP, on 0.0.0.0 and :: (IPv6-only sockets, so IPv4 clients show up as
plain IPv4). Prints ``ready`` (flushed) once every socket is bound; exits 0 on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

    from kpx_cluster.netns import Target, Topology

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)  # Linux value; not exported by Python 3.11
_IN_PKTINFO = struct.Struct("=i4s4s")  # ipi_ifindex, ipi_spec_dst, ipi_addr
_IN6_PKTINFO = struct.Struct("=16sI")  # ipi6_addr, ipi6_ifindex
_ANC_SPACE = socket.CMSG_SPACE(_IN6_PKTINFO.size) + socket.CMSG_SPACE(_IN_PKTINFO.size)


# A backend lives in its own netns, so it answers on every address there.
DEFAULT_BINDS = ("0.0.0.0", "::")  # noqa: S104


class _Stop(Exception):
    """Raised by the signal handler to leave the serve loop."""


def client_ip(address: str) -> str:
    """A client address as printed: no IPv4-mapped prefix, no scope id."""
    address = address.split("%", 1)[0]
    return address.removeprefix("::ffff:") if "." in address else address


def _bind(family: int, kind: int, addr: str, port: int, v6only: bool) -> socket.socket:
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0)
        if kind == socket.SOCK_DGRAM:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
            if family == socket.AF_INET or not v6only:
                sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        sock.bind((addr, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def open_sockets(
    ports: Sequence[int], binds: Sequence[str], tcp: bool, udp: bool
) -> list[socket.socket]:
    """Bind every (port, address, protocol) combination."""
    has_v4 = any(":" not in b for b in binds)
    kinds = [k for k, on in ((socket.SOCK_STREAM, tcp), (socket.SOCK_DGRAM, udp)) if on]
    socks: list[socket.socket] = []
    try:
        for port in ports:
            for addr in binds:
                family = socket.AF_INET6 if ":" in addr else socket.AF_INET
                socks.extend(_bind(family, kind, addr, port, v6only=has_v4) for kind in kinds)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _answer_tcp(listener: socket.socket, name: str) -> None:
    try:
        conn, peer = listener.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return
    with conn:
        conn.settimeout(2.0)
        with contextlib.suppress(OSError):
            conn.sendall(f"{name} {client_ip(peer[0])}\n".encode())
            conn.shutdown(socket.SHUT_WR)


def _reply_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes]]:
    """Ancillary data making the reply leave from the address the request was sent to."""
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO:
            _ifindex, _spec, dst = _IN_PKTINFO.unpack_from(data)
            return [(level, kind, _IN_PKTINFO.pack(0, dst, bytes(4)))]
        if level == socket.IPPROTO_IPV6 and kind == socket.IPV6_PKTINFO:
            dst6, ifindex = _IN6_PKTINFO.unpack_from(data)
            return [(level, kind, _IN6_PKTINFO.pack(dst6, ifindex))]
    return []


def _answer_udp(sock: socket.socket, name: str) -> None:
    try:
        _data, ancdata, _flags, peer = sock.recvmsg(65535, _ANC_SPACE)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        return  # e.g. a queued ICMP error for an earlier reply
    reply = f"{name} {client_ip(peer[0])}\n".encode()
    try:
        sock.sendmsg([reply], _reply_ancillary(ancdata), 0, peer)
    except OSError:
        with contextlib.suppress(OSError):
            sock.sendto(reply, peer)  # e.g. sent to a broadcast address: let routing choose


def serve(name: str, socks: Sequence[socket.socket]) -> None:
    """Answer on `socks` until SIGTERM/SIGINT."""
    sel = selectors.DefaultSelector()
    for sock in socks:
        sel.register(sock, selectors.EVENT_READ)

    def stop(_signum: int, _frame: FrameType | None) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    try:
        while True:
            for key, _events in sel.select():
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                if ready.type == socket.SOCK_STREAM:
                    _answer_tcp(ready, name)
                else:
                    _answer_udp(ready, name)
    except _Stop:
        pass
    finally:
        sel.close()
        for sock in socks:
            sock.close()


def start(
    topology: Topology,
    target: Target,
    name: str,
    *ports: int,
    tcp: bool = True,
    udp: bool = True,
    binds: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start an echo server inside `target` through `topology` and wait until it is ready."""
    if not (tcp or udp):
        raise ValueError("serve at least one of tcp and udp")
    argv = [sys.executable, "-m", "kpx_cluster.echo_server", "--name", name]
    for port in ports:
        argv += ["--port", str(port)]
    if tcp != udp:
        argv.append("--tcp" if tcp else "--udp")
    for addr in binds:
        argv += ["--bind", addr]
    return topology.run_ready(target, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m kpx_cluster.echo_server", description=__doc__)
    parser.add_argument("--name", required=True, help="the name this backend answers with")
    parser.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    parser.add_argument("--tcp", action="store_true", help="serve TCP (default: TCP and UDP)")
    parser.add_argument("--udp", action="store_true", help="serve UDP (default: TCP and UDP)")
    parser.add_argument(
        "--bind", action="append", help="address to bind, repeatable (default: 0.0.0.0 and ::)"
    )
    args = parser.parse_args(argv)
    tcp, udp = (args.tcp, args.udp) if (args.tcp or args.udp) else (True, True)
    if any(c.isspace() for c in args.name) or not args.name:
        parser.error("--name must be a non-empty word")
    socks = open_sockets(args.port, args.bind or DEFAULT_BINDS, tcp, udp)
    serve(args.name, socks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
