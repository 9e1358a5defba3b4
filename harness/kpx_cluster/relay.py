"""Byte relay between TCP and a filesystem unix socket (which crosses network namespaces).

Lets a process in a node netns reach a server that listens only on the host's 127.0.0.1:

    host netns:  python -m kpx_cluster.relay unix-to-tcp --unix /tmp/x.sock --to 127.0.0.1:6443
    node netns:  python -m kpx_cluster.relay tcp-to-unix --listen 127.0.0.1:6443 --unix /tmp/x.sock

Both print ``ready`` (flushed) once listening and exit cleanly on SIGTERM/SIGINT. Data is copied
verbatim in both directions with half-close (EOF) propagated, so TLS passes through.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import stat
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

BUFSIZE = 65536

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(BUFSIZE):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy a->b and b->a until both directions reached EOF or one failed; then close both."""
    tasks = {
        asyncio.create_task(_pump(a_reader, b_writer)),
        asyncio.create_task(_pump(b_reader, a_writer)),
    }
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a reset on one side just ends the connection
    finally:
        for task in tasks:
            task.cancel()
        for writer in (a_writer, b_writer):
            writer.close()
        for writer in (a_writer, b_writer):
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _handler(
    open_upstream: Opener,
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await open_upstream()
        except OSError as err:
            print(f"relay: upstream connect failed: {err}", file=sys.stderr, flush=True)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        await splice(reader, writer, up_reader, up_writer)

    return handle


def _remove_stale_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


async def serve_unix_to_tcp(unix_path: str | Path, host: str, port: int) -> asyncio.Server:
    """Listen on unix socket `unix_path` (mode 0600); relay each connection to host:port."""
    path = Path(unix_path)
    _remove_stale_socket(path)

    async def upstream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    old_umask = os.umask(0o177)
    try:
        return await asyncio.start_unix_server(_handler(upstream), path=str(path))
    finally:
        os.umask(old_umask)


async def serve_tcp_to_unix(host: str, port: int, unix_path: str | Path) -> asyncio.Server:
    """Listen on TCP host:port; relay each connection to the unix socket `unix_path`."""

    async def upstream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(unix_path))

    return await asyncio.start_server(_handler(upstream), host=host, port=port, reuse_address=True)


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[V6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def _serve(args: argparse.Namespace) -> None:
    if args.mode == "unix-to-tcp":
        host, port = args.to
        server = await serve_unix_to_tcp(args.unix, host, port)
    else:
        host, port = args.listen
        server = await serve_tcp_to_unix(host, port, args.unix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        if args.mode == "unix-to-tcp":
            _remove_stale_socket(Path(args.unix))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m kpx_cluster.relay", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    u2t = sub.add_parser("unix-to-tcp", help="listen on a unix socket, connect to TCP")
    u2t.add_argument("--unix", required=True, help="unix socket path to listen on")
    u2t.add_argument("--to", required=True, type=parse_hostport, help="HOST:PORT to connect to")
    t2u = sub.add_parser("tcp-to-unix", help="listen on TCP, connect to a unix socket")
    t2u.add_argument("--listen", required=True, type=parse_hostport, help="HOST:PORT to listen on")
    t2u.add_argument("--unix", required=True, help="unix socket path to connect to")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
