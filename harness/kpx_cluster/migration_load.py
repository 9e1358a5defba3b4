"""Constant load for a migration under traffic (issue #18): what runs inside a pod's netns.

    python -m kpx_cluster.migration_load client --tcp HOST:PORT [--tcp ...] [--udp HOST:PORT ...]
        [--hold HOST:PORT --holds N] [--interval S] [--udp-interval S] [--timeout S] [--out F]
    python -m kpx_cluster.migration_load hold-server --name NAME --port P

client: opens a new TCP connection every `interval` seconds, round-robin over the --tcp targets
(each answered by `echo_server`: one line, then close); sends one UDP datagram every
`udp-interval` seconds on a new socket, round-robin over the --udp targets, and waits for the
reply; keeps `holds` TCP connections to --hold open, each exchanging a line every 100 ms with a
`hold-server`. It prints ``ready`` once every held connection answered, runs until its stdin
closes (or SIGTERM), waits for the tries under way, and prints one JSON object: the `Summary`.

A try fails when it gets no answer within `timeout` (refused, reset, no reply); a try answered
after more than `SLOW` seconds is counted as slow too (a SYN or datagram the kernel retried:
a packet was lost). A held connection survives when every exchange answered, on one backend.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: An answer later than this (s) had a packet retransmitted (the first SYN retry is at 1 s).
SLOW = 0.9
HOLD_PERIOD = 0.1


@dataclass
class Tries:
    """New connections (or UDP exchanges): how many, which failed and why, which were slow."""

    tried: int = 0
    failed: int = 0
    slow: int = 0
    backends: dict[str, int] = field(default_factory=dict)
    #: (seconds since the start, target, reason) of the first failures
    failures: list[tuple[float, str, str]] = field(default_factory=list)
    #: target -> [tried, failed] (the fault-injection suite splits by the node a target is on)
    targets: dict[str, list[int]] = field(default_factory=dict)

    def start(self, target: str) -> None:
        self.tried += 1
        self.targets.setdefault(target, [0, 0])[0] += 1

    def answer(self, name: str, took: float) -> None:
        self.backends[name] = self.backends.get(name, 0) + 1
        if took > SLOW:
            self.slow += 1

    def fail(self, at: float, target: str, reason: str) -> None:
        self.failed += 1
        self.targets.setdefault(target, [0, 0])[1] += 1
        if len(self.failures) < 50:
            self.failures.append((round(at, 3), target, reason))


@dataclass
class Held:
    """One long-lived connection: its exchanges, the backends that answered, how it ended."""

    target: str
    exchanges: int = 0
    backends: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def survived(self) -> bool:
        return not self.error and self.exchanges > 0 and len(self.backends) == 1


@dataclass
class Summary:
    duration: float
    tcp: Tries
    udp: Tries
    held: list[Held]
    #: the wall clock (time.time()) at the start that the failures' times count from
    started_at: float = 0.0

    def to_json(self) -> str:
        out: dict[str, Any] = asdict(self)
        for h, held in zip(out["held"], self.held, strict=True):
            h["survived"] = held.survived
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        raw = json.loads(text)
        tries = {
            k: Tries(**{**raw[k], "failures": [tuple(f) for f in raw[k]["failures"]]})
            for k in ("tcp", "udp")
        }
        held = [Held(h["target"], h["exchanges"], h["backends"], h["error"]) for h in raw["held"]]
        return cls(raw["duration"], tries["tcp"], tries["udp"], held, raw.get("started_at", 0.0))

    @property
    def held_survived(self) -> int:
        return sum(1 for h in self.held if h.survived)


def failure(reason: str, sock: socket.socket) -> str:
    """A failed try's reason, with the source port it used when it had one:
    ``timeout (port 40312)``."""
    try:
        port = sock.getsockname()[1]
    except OSError:  # closed
        port = 0
    return f"{reason} (port {port})" if port else reason


def split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tcp, self.udp = Tries(), Tries()
        self.held = [Held(args.hold) for _ in range(args.holds if args.hold else 0)]
        self.stopping = asyncio.Event()
        self.start = time.monotonic()
        self.started_at = time.time()
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def tcp_try(self, target: str) -> None:
        at = time.monotonic()
        host, port = split_target(target)
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        writer = None
        try:
            # bound first, so that a failure can name its source port (a node's conntrack
            # events tell the connection apart by it: kpx_cluster.node_events)
            sock.bind(("", 0))
            async with asyncio.timeout(self.args.timeout):
                await loop.sock_connect(sock, (host, port))
                reader, writer = await asyncio.open_connection(sock=sock)
                line = await reader.readline()
            if not line:
                raise ConnectionError("closed without an answer")
            self.tcp.answer(line.split()[0].decode(), time.monotonic() - at)
        except TimeoutError:
            self.tcp.fail(at - self.start, target, failure("timeout", sock))
        except OSError as err:
            self.tcp.fail(at - self.start, target, failure(type(err).__name__, sock))
        finally:
            if writer is not None:
                writer.close()
            else:
                sock.close()

    async def udp_try(self, target: str) -> None:
        at = time.monotonic()
        host, port = split_target(target)
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            try:
                async with asyncio.timeout(self.args.timeout):
                    await loop.sock_connect(sock, (host, port))
                    await loop.sock_sendall(sock, b"kpx-migration\n")
                    data = await loop.sock_recv(sock, 512)
                self.udp.answer(data.split()[0].decode(), time.monotonic() - at)
            except TimeoutError:
                self.udp.fail(at - self.start, target, failure("timeout", sock))
            except (OSError, IndexError) as err:
                self.udp.fail(at - self.start, target, failure(type(err).__name__, sock))

    async def ticker(self, interval: float, targets: Sequence[str], kind: str) -> None:
        i = 0
        next_at = time.monotonic()
        while not self.stopping.is_set():
            target = targets[i % len(targets)]
            if kind == "tcp":
                self.tcp.start(target)
                self.spawn(self.tcp_try(target))
            else:
                self.udp.start(target)
                self.spawn(self.udp_try(target))
            i += 1
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < -1:  # fell far behind (a stalled machine): do not burst to catch up
                next_at = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), max(delay, 0))

    async def hold(self, held: Held, connected: asyncio.Event) -> None:
        host, port = split_target(held.target)
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as err:
            held.error = f"connect: {type(err).__name__}"
            connected.set()
            return
        try:
            i = 0
            while not self.stopping.is_set():
                writer.write(b"ping %d\n" % i)
                async with asyncio.timeout(self.args.timeout):
                    await writer.drain()
                    answer = (await reader.readline()).decode().split()
                if len(answer) != 3 or answer[2] != str(i):
                    raise ConnectionError(f"bad answer {answer}")
                held.exchanges += 1
                if answer[0] not in held.backends:
                    held.backends.append(answer[0])
                connected.set()
                i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), HOLD_PERIOD)
        except (OSError, TimeoutError) as err:
            held.error = f"{time.monotonic() - self.start:.3f}s: {type(err).__name__} {err}"
        finally:
            connected.set()
            writer.close()

    async def run(self) -> Summary:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_reader(sys.stdin.fileno(), self._stdin)
        events = [asyncio.Event() for _ in self.held]
        holders = [
            loop.create_task(self.hold(h, e)) for h, e in zip(self.held, events, strict=True)
        ]
        for event in events:
            await event.wait()
        print("ready", flush=True)
        self.start = time.monotonic()
        self.started_at = time.time()
        tickers = []
        if self.args.tcp:
            tickers.append(loop.create_task(self.ticker(self.args.interval, self.args.tcp, "tcp")))
        if self.args.udp:
            tickers.append(
                loop.create_task(self.ticker(self.args.udp_interval, self.args.udp, "udp"))
            )
        await self.stopping.wait()
        duration = time.monotonic() - self.start
        await asyncio.gather(*tickers, *holders)
        if self.tasks:
            await asyncio.wait(set(self.tasks))
        return Summary(round(duration, 3), self.tcp, self.udp, self.held, self.started_at)

    def _stdin(self) -> None:
        if not os.read(sys.stdin.fileno(), 4096):
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self.stopping.set()


async def hold_server(name: str, port: int) -> None:
    """Answers each line of each connection with ``NAME LINE`` until the peer closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while line := await reader.readline():
                writer.write(name.encode() + b" " + line)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host=["0.0.0.0", "::"], port=port)  # noqa: S104
    print("ready", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpx_cluster.migration_load")
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("client")
    client.add_argument("--tcp", action="append", default=[])
    client.add_argument("--udp", action="append", default=[])
    client.add_argument("--hold", default="")
    client.add_argument("--holds", type=int, default=2)
    client.add_argument("--interval", type=float, default=0.015)
    client.add_argument("--udp-interval", type=float, default=0.05)
    client.add_argument("--timeout", type=float, default=3.0)
    client.add_argument("--out", default="", help="also write the summary to this file")
    server = sub.add_parser("hold-server")
    server.add_argument("--name", required=True)
    server.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "hold-server":
        asyncio.run(hold_server(args.name, args.port))
        return 0
    summary = asyncio.run(Client(args).run()).to_json()
    if args.out:
        Path(args.out).write_text(summary)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
