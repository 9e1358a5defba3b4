"""The ipvs backend's edges: IPVS and links over netlink (pyroute2), the helper nftables table
(nft), the node sysctls IPVS needs. Nothing here decides anything.

The backend reaches them through one object, `NodeKernel` (its fake, for the tests and for
anyone embedding the backend, is `fake.FakeKernel`, shaped by the same `Kernel` protocol)."""

from __future__ import annotations

import errno
import functools
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from ..kernel import nft_query
from ..kernel.names import IPVS_DUMMY, IPVS_TABLE, NFT_FAMILIES
from ..kernel.nft_transaction import TableContents, Transaction
from . import wire
from .batch import NETLINK_ROUTE, Chunker, RawNetlink, describe_errors
from .model import PROTOCOLS, VirtualKey, VirtualServer

DUMMY = IPVS_DUMMY
TABLE = IPVS_TABLE
NFPROTO = {4: socket.AF_INET, 6: socket.AF_INET6}  # NFPROTO_IPV4/6 equal AF_INET/6
#: IP_VS_CONN_F_MASQ: NAT (pyroute2's IPVSDest defaults to 3, direct routing).
FWD_NAT = 0
#: An IPv6 virtual server's netmask is a prefix length (128) in a host-order u32, as ipvsadm
#: sends it (the kernel refuses a full IPv6 service without it: EINVAL); pyroute2 encodes the
#: attribute as an IPv4 address, so the u32's bytes are given as one.
V6_NETMASK = socket.inet_ntoa((128).to_bytes(4, sys.byteorder))
_FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}
_PROTOCOL_NAME = {number: name for name, number in PROTOCOLS.items()}


class KernelError(RuntimeError):
    pass


class RealServer(NamedTuple):
    weight: int
    connections: int  # active plus inactive
    active: int = 0  # established (TCP): IPVS's ActiveConn


def _ipvs():
    from pyroute2 import IPVS

    try:
        return IPVS()
    except Exception as exc:  # the netlink family is missing: no ip_vs module
        raise KernelError(f"IPVS is not available in this kernel: {exc}") from exc


def ipvs_available() -> bool:
    try:
        _ipvs().close()
    except KernelError:
        return False
    return True


def _service(key: VirtualKey, vs: VirtualServer | None = None):
    from pyroute2 import IPVSService

    fields: dict[str, object] = {
        "af": _FAMILY[key.family],
        "addr": key.address,
        "port": key.port,
        "protocol": PROTOCOLS[key.protocol],
    }
    if key.family == 6:
        fields["netmask"] = V6_NETMASK
    if vs is not None:
        fields["sched_name"] = vs.scheduler
        fields["timeout"] = vs.persistence
        fields["flags"] = {"flags": 0x0001 if vs.persistence else 0, "mask": 0xFFFF}
    return IPVSService(**fields)


@functools.lru_cache(maxsize=4096)
def _service_key_attrs(key: VirtualKey) -> bytes:
    """A virtual server's key attributes (every request about one of its real servers)."""
    return wire.service_attrs(key)


class _RealServerRequest(NamedTuple):
    """What a real-server request does, made a sentence only if it fails (cheap to queue)."""

    verb: str
    address: str
    port: int
    key: VirtualKey

    def __str__(self) -> str:
        return f"{self.verb} real server {self.address}:{self.port} of {_name(self.key)}"


def _name(key: VirtualKey) -> str:
    address = f"[{key.address}]" if key.family == 6 else key.address
    return f"{key.protocol} {address}:{key.port}"


def _dest(address: str, port: int, weight: int):
    from pyroute2 import IPVSDest

    return IPVSDest(addr=address, port=port, weight=weight, fwd_method=FWD_NAT)


class Ipvs:
    """IPVS over netlink, for the life of the backend: pyroute2's socket resolves the family
    and reads (dumps); changes are requests (wire.py) queued and sent in batches (batch.py)
    by `flush`, which every read does first and the backend does at the end of a
    sync. A failed request does not stop the others: `flush` raises one KernelError naming
    every object whose request failed."""

    def __init__(self) -> None:
        self._sock = _ipvs()
        self._family = int(self._sock.prid)
        self._raw: RawNetlink | None = None
        self._queue = Chunker()
        self._seq = 0

    def close(self) -> None:
        self._queue.pending.clear()
        self._sock.close()
        if self._raw is not None:
            self._raw.close()

    def _request(self, cmd: int, attrs: bytes, what: object) -> None:
        self._seq = self._seq % 0x7FFFFFFF + 1
        self._queue.pending.append(
            (self._seq, wire.message(self._family, self._seq, cmd, attrs), what)
        )

    def discard(self) -> None:
        """Forget the queued changes (a sync failed before sending them: the next is full)."""
        self._queue.pending.clear()

    def flush(self) -> None:
        """Send every queued change; KernelError lists those the kernel refused."""
        if not self._queue.pending:
            return
        if self._raw is None:
            self._raw = RawNetlink()
        failed: list[tuple[object, int]] = []
        for chunk in self._queue.chunks():
            failed += self._raw.exchange(chunk)
        if failed:
            raise KernelError(describe_errors(failed))

    def add_service(self, vs: VirtualServer) -> None:
        self._request(
            wire.NEW_SERVICE, wire.service_attrs(vs.key, vs), f"add virtual server {_name(vs.key)}"
        )

    def set_service(self, vs: VirtualServer) -> None:
        self._request(
            wire.SET_SERVICE,
            wire.service_attrs(vs.key, vs),
            f"change virtual server {_name(vs.key)}",
        )

    def delete_service(self, key: VirtualKey) -> None:
        self._request(
            wire.DEL_SERVICE, wire.service_attrs(key), f"delete virtual server {_name(key)}"
        )

    def _dest_request(
        self, cmd: int, key: VirtualKey, address: str, port: int, weight: int, what: str
    ) -> None:
        attrs = _service_key_attrs(key) + wire.dest_attrs(key.family, address, port, weight)
        self._request(cmd, attrs, _RealServerRequest(what, address, port, key))

    def set_dest(self, key: VirtualKey, address: str, port: int, weight: int, new: bool) -> None:
        if new:
            self._dest_request(wire.NEW_DEST, key, address, port, weight, "add")
        else:
            self._dest_request(wire.SET_DEST, key, address, port, weight, f"set weight {weight} of")

    def delete_dest(self, key: VirtualKey, address: str, port: int) -> None:
        self._dest_request(wire.DEL_DEST, key, address, port, 0, "delete")

    def services(self) -> Iterator[VirtualKey]:
        from pyroute2 import IPVSService

        self.flush()
        for message in self._sock.service("dump"):
            s = IPVSService.from_message(message)
            family = 6 if s.get("af") == socket.AF_INET6 else 4
            if s.get("fwmark"):
                continue
            yield VirtualKey(
                family, _PROTOCOL_NAME.get(s["protocol"], "?"), str(s["addr"]), int(s["port"])
            )

    def real_servers(self, key: VirtualKey) -> dict[tuple[str, int], RealServer]:
        """The real servers of `key`: weight, and active plus inactive connections."""
        self.flush()
        out: dict[tuple[str, int], RealServer] = {}
        for message in self._sock.dest("dump", service=_service(key)):
            attrs = dict(message.get("IPVS_CMD_ATTR_DEST")["attrs"])
            active = int(attrs.get("IPVS_DEST_ATTR_ACTIVE_CONNS", 0))
            conns = active + int(attrs.get("IPVS_DEST_ATTR_INACT_CONNS", 0))
            server = (str(attrs["IPVS_DEST_ATTR_ADDR"]), int(attrs["IPVS_DEST_ATTR_PORT"]))
            out[server] = RealServer(int(attrs.get("IPVS_DEST_ATTR_WEIGHT", 0)), conns, active)
        return out


# ---- the dummy interface ------------------------------------------------------------------------


def ensure_dummy() -> int:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=DUMMY)
        if not found:
            ipr.link("add", ifname=DUMMY, kind="dummy")
            found = ipr.link_lookup(ifname=DUMMY)
        ipr.link("set", index=found[0], state="up")
        return int(found[0])


def bind(address_changes: Iterable[tuple[bool, int, str]]) -> None:
    """(add?, family, address) on the dummy interface (/32 or /128, as upstream), sent in
    batches (an address already there, or already gone, is fine)."""
    from pyroute2 import IPRoute

    changes = list(address_changes)
    if not changes:
        return
    with IPRoute() as ipr:
        index = int(ipr.link_lookup(ifname=DUMMY)[0])
    queue = Chunker()
    for seq, (add, family, address) in enumerate(changes, start=1):
        what = f"{'add' if add else 'delete'} address {address} of {DUMMY}"
        queue.pending.append((seq, wire.address_message(seq, add, family, index, address), what))
    raw = RawNetlink(NETLINK_ROUTE)
    failed: list[tuple[object, int]] = []
    try:
        for chunk in queue.chunks():
            failed += [
                (what, code)
                for what, code in raw.exchange(chunk)
                if code not in (errno.EEXIST, errno.EADDRNOTAVAIL)
            ]
    finally:
        raw.close()
    if failed:
        raise KernelError(describe_errors(failed))


def bound_addresses() -> set[tuple[int, str]]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=DUMMY)
        if not found:
            return set()
        return {
            (4 if a["family"] == socket.AF_INET else 6, str(a.get_attr("IFA_ADDRESS")))
            for a in ipr.get_addr(index=found[0])
        }


def delete_dummy() -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=DUMMY):
            ipr.link("del", index=index)


# ---- nft and sysctls ----------------------------------------------------------------------------


def run_nft(script: str) -> None:
    result = subprocess.run(
        ["nft", "-f", "-"], input=script, text=True, capture_output=True, check=False
    )
    if result.returncode != 0:
        raise KernelError(f"nft: {result.stderr.strip()}")


def delete_tables() -> None:
    for family in NFT_FAMILIES.values():
        subprocess.run(["nft", "delete", "table", family, TABLE], capture_output=True, check=False)


#: The node's net.ipv4 sysctls as the agent's own network namespace shows them. A pod's own
#: /proc/sys is read-only: in mode ipvs the operator mounts the node's directory elsewhere
#: (`--ipv4-sysctl-dir`).
IPV4_SYSCTL_DIR = Path("/proc/sys/net/ipv4")
IPV4_PREFIX = "net.ipv4."


def sysctl_path(name: str, ipv4_dir: Path = IPV4_SYSCTL_DIR) -> Path:
    """Where sysctl `name` (net.ipv4.*: the only ones ipvs mode sets) is under `ipv4_dir`."""
    if not name.startswith(IPV4_PREFIX):
        raise ValueError(f"{name}: not a net.ipv4 sysctl")
    return ipv4_dir.joinpath(*name[len(IPV4_PREFIX) :].split("."))


def write_sysctl(name: str, value: int, ipv4_dir: Path = IPV4_SYSCTL_DIR) -> None:
    """Set sysctl `name` to `value` unless it has that value already (a read-only file that
    holds it is no error). Raises KernelError naming the sysctl, the file and why."""
    path = sysctl_path(name, ipv4_dir)
    try:
        if path.read_text().strip() == str(value):
            return
        path.write_text(f"{value}\n")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise KernelError(
            f"cannot set {name}={value} ({path}: {reason}); the agent needs the node's"
            f" {ipv4_dir} writable (the operator mounts it in mode ipvs: --ipv4-sysctl-dir)"
        ) from exc


def set_timeouts(tcp: int, tcp_fin: int, udp: int) -> None:
    """IPVS connection timeouts; 0 keeps the kernel's value (ipvsadm --set semantics)."""
    if tcp or tcp_fin or udp:
        subprocess.run(
            ["ipvsadm", "--set", str(tcp), str(tcp_fin), str(udp)], check=True, capture_output=True
        )


# ---- the backend's one way to the kernel ---------------------------------------------------------


class VirtualServers(Protocol):
    """What the backend asks of IPVS (`Ipvs`, or the fake's `FakeIpvs`)."""

    def discard(self) -> None: ...
    def flush(self) -> None: ...
    def add_service(self, vs: VirtualServer) -> None: ...
    def set_service(self, vs: VirtualServer) -> None: ...
    def delete_service(self, key: VirtualKey) -> None: ...
    def set_dest(
        self, key: VirtualKey, address: str, port: int, weight: int, new: bool
    ) -> None: ...
    def delete_dest(self, key: VirtualKey, address: str, port: int) -> None: ...
    def services(self) -> Iterable[VirtualKey]: ...
    def real_servers(self, key: VirtualKey) -> dict[tuple[str, int], RealServer]: ...


class Kernel(Protocol):
    """Every kernel edge the ipvs backend uses, as one object."""

    def ipvs(self) -> VirtualServers: ...
    def write_sysctl(self, name: str, value: int) -> None: ...
    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None: ...
    def ensure_dummy(self) -> int: ...
    def bound_addresses(self) -> set[tuple[int, str]]: ...
    def bind(self, address_changes: Iterable[tuple[bool, int, str]]) -> None: ...
    def run_nft(self, transaction: Transaction) -> None: ...
    def table_contents(self, family: int) -> TableContents | None: ...


class NodeKernel:
    """This node's kernel (the functions above); `run_nft` renders the typed transaction for
    `nft -f`, the one place it becomes text. Raises KernelError where they do."""

    def __init__(self, ipv4_sysctl_dir: Path | None = None) -> None:
        self.ipv4_sysctl_dir = ipv4_sysctl_dir or IPV4_SYSCTL_DIR

    def ipvs(self) -> VirtualServers:
        return Ipvs()

    def write_sysctl(self, name: str, value: int) -> None:
        write_sysctl(name, value, self.ipv4_sysctl_dir)

    def set_timeouts(self, tcp: int, tcp_fin: int, udp: int) -> None:
        set_timeouts(tcp, tcp_fin, udp)

    def ensure_dummy(self) -> int:
        return ensure_dummy()

    def bound_addresses(self) -> set[tuple[int, str]]:
        return bound_addresses()

    def bind(self, address_changes: Iterable[tuple[bool, int, str]]) -> None:
        bind(address_changes)

    def run_nft(self, transaction: Transaction) -> None:
        run_nft(transaction.render())

    def table_contents(self, family: int) -> TableContents | None:
        """What the helper table of `family` (4, 6) holds, by name (None: not to be listed)."""
        return nft_query.table_contents(NFPROTO[family], TABLE)
