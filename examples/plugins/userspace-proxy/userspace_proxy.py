"""An out-of-tree kpx backend with no netfilter: a userspace TCP proxy for ClusterIPs.

    python3 userspace_proxy.py [--target unix:///run/proxy-agent/state.sock]

For each TCP Service port with cluster IPs it listens on (cluster IP, port) and relays every
connection to one of the port's cluster endpoints (round robin; reject = close when there is
none). Listeners bind with IP_FREEBIND, so the cluster IPs need not be configured yet; packets
to them must reach this node's stack (e.g. `ip route add local 10.96.0.0/12 dev lo`).
Built only on kpx_localstate_client; the proxy runs in an asyncio loop in its own thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import socket
import threading

from kpx_localstate_client import DEFAULT_TARGET, State, default_target, localstate_pb2, run

log = logging.getLogger("userspace-proxy")
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)

Address = tuple[str, int]  # (cluster IP, port)
Backends = tuple[Address, ...]  # the endpoints


def desired(state: State) -> dict[Address, Backends]:
    """The listeners the state asks for: TCP cluster IPs -> their cluster endpoints."""
    out: dict[Address, Backends] = {}
    for port in state.service_ports.values():
        if port.key.protocol != localstate_pb2.TCP:
            continue
        endpoints = tuple((e.ip, e.port) for e in port.cluster_endpoints)
        for ip in port.cluster_ips:
            out[(ip, port.port)] = endpoints
    return out


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.write_eof()


class Proxy:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: dict[Address, asyncio.Server] = {}
        self.backends: dict[Address, Backends] = {}
        self.turn: dict[Address, itertools.count[int]] = {}

    def start(self) -> None:
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def apply(self, wanted: dict[Address, Backends]) -> None:
        """From the client's thread: make the listeners match (waits until done)."""
        asyncio.run_coroutine_threadsafe(self._apply(wanted), self.loop).result()

    async def _apply(self, wanted: dict[Address, Backends]) -> None:
        self.backends = wanted
        for address in set(self.servers) - set(wanted):
            self.servers.pop(address).close()
            log.info("stopped %s:%d", *address)
        for address in set(wanted) - set(self.servers):
            try:
                self.servers[address] = await self._listen(address)
                log.info("proxying %s:%d", *address)
            except OSError as exc:
                log.error("cannot listen on %s:%d: %s", *address, exc)

    async def _listen(self, address: Address) -> asyncio.Server:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        level = socket.IPPROTO_IPV6 if family == socket.AF_INET6 else socket.IPPROTO_IP
        sock.setsockopt(level, IP_FREEBIND, 1)
        sock.bind(address)
        return await asyncio.start_server(
            lambda r, w: self._relay(address, r, w), sock=sock, backlog=512
        )

    async def _relay(
        self, address: Address, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        endpoints = self.backends.get(address, ())
        if not endpoints:  # no endpoint: reject
            writer.close()
            return
        n = next(self.turn.setdefault(address, itertools.count()))
        host, port = endpoints[n % len(endpoints)]
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        writer.close()
        up_writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", default=default_target(), help=f"default: $KPX_STATE_API, else {DEFAULT_TARGET}"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    proxy = Proxy()
    proxy.start()
    run(lambda state: proxy.apply(desired(state)), args.target)


if __name__ == "__main__":
    main()
