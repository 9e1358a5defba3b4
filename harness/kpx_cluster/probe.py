"""Client side of datapath tests: count which backends answer, and how failures look.

    python -m kpx_cluster.probe --target HOST:PORT|[V6]:PORT --count N --proto tcp|udp
                                --timeout SECONDS [--same-socket] [--interval S]

prints one JSON object::

    {"answers": {"NAME": count}, "sources": {"NAME": ["client ip seen", ...]},
     "refused": n, "timeout": n, "errors": {"message": n}}

TCP: ECONNREFUSED (a RST or an ICMP reject) is "refused", a connect or read timeout is
"timeout". UDP: each try sends one datagram on a connected socket (a new one per try unless
--same-socket) and waits for the reply; ICMP port-unreachable surfaces as ECONNREFUSED, so it is
"refused"; no reply is "timeout". Anything else is counted in "errors" by message.

`probe` makes the same tries in a thread inside a netns of a Topology and returns a
`ProbeResult`; the CLI is for a shell in any netns (``ip netns exec NS python3 -m ...``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kpx_cluster.netns import Target, Topology

UDP_PAYLOAD = b"kpx-probe\n"


@dataclass
class ProbeResult:
    """Outcome of N tries: answers and client addresses seen per backend name, failures."""

    answers: dict[str, int] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)
    refused: int = 0
    timeout: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def backends(self) -> set[str]:
        """Names of the backends that answered at least once."""
        return set(self.answers)

    @property
    def answered(self) -> int:
        """Number of tries that got an answer."""
        return sum(self.answers.values())

    @property
    def failed(self) -> int:
        """Number of tries that got no answer (refused, timeout or another error)."""
        return self.refused + self.timeout + sum(self.errors.values())

    def record_answer(self, line: str) -> None:
        """Count one reply line ``NAME <client ip>``."""
        parts = line.split()
        if len(parts) != 2:
            self.record_error(f"bad reply {line[:60]!r}")
            return
        name, source = parts
        self.answers[name] = self.answers.get(name, 0) + 1
        seen = self.sources.setdefault(name, [])
        if source not in seen:
            seen.append(source)

    def record_error(self, message: str) -> None:
        """Count one failure that is neither refused nor timeout."""
        self.errors[message] = self.errors.get(message, 0) + 1

    def to_json(self) -> str:
        """The CLI's output format."""
        return json.dumps(
            {
                "answers": self.answers,
                "sources": self.sources,
                "refused": self.refused,
                "timeout": self.timeout,
                "errors": self.errors,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        """Parse the CLI's output."""
        data: dict[str, Any] = json.loads(text)
        return cls(
            answers={str(k): int(v) for k, v in data["answers"].items()},
            sources={str(k): [str(s) for s in v] for k, v in data["sources"].items()},
            refused=int(data["refused"]),
            timeout=int(data["timeout"]),
            errors={str(k): int(v) for k, v in data["errors"].items()},
        )


def parse_target(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[V6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT or [V6]:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_target(host: str, port: int) -> str:
    """The inverse of parse_target."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _sockaddr(host: str, port: int, kind: int) -> tuple[int, tuple[Any, ...]]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=kind)[0]
        return family, addr
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (host, port)


def _error_message(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _read_line(sock: socket.socket) -> str:
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _try_tcp(result: ProbeResult, host: str, port: int, timeout: float) -> None:
    family, addr = _sockaddr(host, port, socket.SOCK_STREAM)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
            line = _read_line(sock)
        except ConnectionRefusedError:
            result.refused += 1
            return
        except TimeoutError:
            result.timeout += 1
            return
        except OSError as err:
            result.record_error(_error_message(err))
            return
    if line:
        result.record_answer(line)
    else:
        result.record_error("empty reply")


def _udp_socket(host: str, port: int, timeout: float) -> socket.socket:
    family, addr = _sockaddr(host, port, socket.SOCK_DGRAM)
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.settimeout(timeout)
    sock.connect(addr)
    return sock


def _drain(sock: socket.socket) -> None:
    """Drop late replies (and pending errors) of earlier tries on a reused socket."""
    sock.setblocking(False)
    try:
        while True:
            try:
                sock.recv(4096)
            except BlockingIOError:
                break
            except OSError:
                continue  # a queued ICMP error is reported once, then cleared
    finally:
        sock.setblocking(True)


def _try_udp(result: ProbeResult, sock: socket.socket, timeout: float) -> None:
    sock.settimeout(timeout)
    try:
        sock.send(UDP_PAYLOAD)
        data = sock.recv(4096)
    except ConnectionRefusedError:
        result.refused += 1
        return
    except TimeoutError:
        result.timeout += 1
        return
    except OSError as err:
        result.record_error(_error_message(err))
        return
    result.record_answer(data.decode(errors="replace").strip())


def run_probe(
    host: str,
    port: int,
    proto: str = "tcp",
    count: int = 1,
    timeout: float = 1.0,
    same_socket: bool = False,
    interval: float = 0.0,
) -> ProbeResult:
    """Make `count` tries from this process (and netns); see the module docstring."""
    result = ProbeResult()
    shared: socket.socket | None = None
    try:
        for i in range(count):
            if i and interval > 0:
                time.sleep(interval)
            if proto == "tcp":
                _try_tcp(result, host, port, timeout)
                continue
            try:
                sock = shared if shared is not None else _udp_socket(host, port, timeout)
            except OSError as err:
                result.record_error(_error_message(err))
                continue
            if same_socket:
                if shared is not None:
                    _drain(shared)
                shared = sock
                _try_udp(result, sock, timeout)
            else:
                with sock:
                    _try_udp(result, sock, timeout)
    finally:
        if shared is not None:
            shared.close()
    return result


def probe(
    topology: Topology,
    target_ns: Target,
    host: str,
    port: int,
    proto: str = "tcp",
    count: int = 1,
    timeout: float = 1.0,
    *,
    same_socket: bool = False,
    interval: float = 0.0,
) -> ProbeResult:
    """Make the tries from inside the netns of `target_ns` (a netns name, Node or Pod).

    The tries run in a thread of this process that joins the netns (`Topology.call`), not in
    a new Python process: under the IPVS guest's emulated CPU a Python start costs about a
    second, and tests probe thousands of times."""
    if proto not in ("tcp", "udp"):
        raise ValueError(f"proto must be tcp or udp, got {proto!r}")
    return topology.call(
        target_ns,
        lambda: run_probe(host, port, proto, count, timeout, same_socket, interval),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m kpx_cluster.probe", description=__doc__)
    parser.add_argument("--target", required=True, type=parse_target, help="HOST:PORT")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds per try")
    parser.add_argument("--same-socket", action="store_true", help="udp: one socket for all")
    parser.add_argument("--interval", type=float, default=0.0, help="seconds between tries")
    args = parser.parse_args(argv)
    host, port = args.target
    result = run_probe(
        host, port, args.proto, args.count, args.timeout, args.same_socket, args.interval
    )
    print(result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
