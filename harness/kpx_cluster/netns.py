"""Network-namespace topology builder: simulated nodes and pods for kpx datapath tests.

A `Topology` builds, entirely inside network namespaces it creates (never in the host netns):

* a "fabric" netns holding one bridge, the shared L2 segment between nodes;
* one netns per node, attached to the fabric with 10.242.0.<i>/24 and fd00:242::<i>/64, holding a
  bridge ``cbr0`` with the gateway of its pod CIDRs 10.244.<i>.0/24 and fd00:244:<i>::/64, routes
  to every other node's pod CIDRs and a route covering the Service CIDRs;
* one netns per pod, with ``eth0`` (a veth whose other end is a hairpin port of its node's cbr0).

Every netns, link, temporary path and process it creates carries a per-run prefix
(``kpx<6 hex>``), so `leftovers` can find anything that escaped cleanup. Cleanup runs on
``__exit__``, on `Topology.cleanup`, at interpreter exit and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import os
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, TypeVar

log = logging.getLogger(__name__)

HARNESS_DIR = Path(__file__).resolve().parent.parent
"""The folder holding the kpx_cluster package; put on PYTHONPATH of every process we start."""

ENV_MARK = "KPX_TOPOLOGY"
"""Environment variable set to the topology prefix in every process started by run/exec."""

PREFIX_RE = re.compile(r"kpx[0-9a-f]{6}")
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")
DEFAULT_SERVICE_CIDRS: tuple[str, ...] = ("10.96.0.0/16", "fd00:96::/112")
IFNAMSIZ = 15
T = TypeVar("T")

# Sysctls for every node / pod netns. Ratelimits are off so that tests counting ICMP errors
# (port unreachable, reject) see one per probe; DAD is off so addresses are usable at once.
_COMMON_SYSCTLS = (
    "net.ipv6.conf.all.accept_dad=0",
    "net.ipv6.conf.default.accept_dad=0",
    "net.ipv4.icmp_ratelimit=0",
    "net.ipv6.icmp.ratelimit=0",
)
_NODE_SYSCTLS = (
    "net.ipv4.ip_forward=1",
    "net.ipv6.conf.all.forwarding=1",
    "net.ipv4.conf.all.rp_filter=0",
    "net.ipv4.conf.default.rp_filter=0",
    "net.ipv4.conf.all.send_redirects=0",
    "net.ipv4.conf.default.send_redirects=0",
)
_BRIDGE_NF_SYSCTLS = ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables")
#: Every node netns's sysctls (a remote node's side sets them as well).
NODE_SYSCTLS = (*_COMMON_SYSCTLS, *_NODE_SYSCTLS)


class TopologyError(RuntimeError):
    """A command building or running the topology failed."""


@dataclass(frozen=True)
class Node:
    """A simulated node: a netns on the fabric with a pod bridge ``cbr0``."""

    name: str
    index: int
    netns: str
    ipv4: str
    ipv6: str
    pod_cidr_v4: str
    pod_cidr_v6: str
    gateway_v4: str
    gateway_v6: str
    fabric_if: str
    bridge: str = "cbr0"

    @property
    def gateway_mac(self) -> str:
        """cbr0's MAC: 0a:58 and the IPv4 gateway's octets (as kubenet and the CNI bridge
        plugin derive it), locally administered and unique per node."""
        return "0a:58:" + ":".join(f"{int(o):02x}" for o in self.gateway_v4.split("."))


@dataclass(frozen=True)
class Pod:
    """A simulated pod: a netns whose ``eth0`` is plugged into its node's ``cbr0``."""

    name: str
    node: Node
    netns: str
    ipv4: str
    ipv6: str
    host_if: str
    interface: str = "eth0"


Target = str | Node | Pod
"""Where to run something: a netns name, a Node or a Pod."""


def node_link_commands(node: Node, service_cidrs: Sequence[str]) -> list[list[str]]:
    """`ip` arguments, run in the node's netns once its fabric link `node.fabric_if` is there:
    the link's addresses, the pod bridge cbr0 with the pod CIDRs' gateways, and routes for the
    Service CIDRs (to the fabric; a proxy answers them before they leave)."""
    fabric = node.fabric_if
    bridge = ["type", "bridge", "mcast_snooping", "0"]
    return [
        ["addr", "add", f"{node.ipv4}/24", "dev", fabric],
        ["addr", "add", f"{node.ipv6}/64", "dev", fabric, "nodad"],
        ["link", "set", fabric, "up"],
        # A fixed MAC (as kubenet gave cbr0): a bridge without one takes its lowest port's, so
        # it changed whenever a pod came or went, and pods that had the old one in their
        # neighbor cache lost whatever they sent the gateway to be routed.
        ["link", "add", "cbr0", "address", node.gateway_mac, *bridge],
        ["addr", "add", f"{node.gateway_v4}/24", "dev", "cbr0"],
        ["addr", "add", f"{node.gateway_v6}/64", "dev", "cbr0", "nodad"],
        ["link", "set", "cbr0", "up"],
        *(["route", "replace", cidr, "dev", fabric] for cidr in service_cidrs),
    ]


_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000


def open_tap(netns: str, name: str) -> int:
    """An open fd on tap device `name` of `netns` (for qemu's `-netdev tap,fd=`); closing it
    leaves the device, which goes with its netns."""

    def attach() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            ifreq = struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI)
            fcntl.ioctl(fd, _TUNSETIFF, ifreq)
        except OSError:
            os.close(fd)
            raise
        return fd

    return call_in_netns(netns, attach)


def netns_of(target: Target) -> str:
    """The netns name of a Node, a Pod, or a netns name given as is."""
    if isinstance(target, Node | Pod):
        return target.netns
    return target


_CLONE_NEWNET = 0x40000000


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace `netns` (a name under /run/netns).

    Network namespaces are per thread: in a fresh thread (see `call_in_netns`) this changes
    only that thread; in `preexec_fn` it puts a child process in `netns` before it execs, so the
    child's pid is the program's own (no wrapper such as ``ip netns exec``)."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run `fn` in a new thread inside network namespace `netns`; return what it returns (or
    raise what it raised). Sockets `fn` opens live in `netns`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            enter_netns(netns)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"in-{netns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _run_ip(args: Sequence[str], netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise TopologyError(f"{' '.join(argv)}: {res.stderr.strip() or res.returncode}")
    return res.stdout


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, check=False
    )
    return [int(tok) for tok in out.stdout.split() if tok.isdigit()]


def _marked_pids(prefix: str | None) -> dict[int, str]:
    """Processes (other than us) whose environment carries ENV_MARK for `prefix` (any if None)."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        for var in environ:
            if not var.startswith(ENV_MARK.encode() + b"="):
                continue
            value = var.split(b"=", 1)[1].decode(errors="replace")
            if (prefix is None and PREFIX_RE.fullmatch(value)) or value == prefix:
                found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _kill_pids(pids: Iterable[int], grace: float) -> None:
    """SIGTERM `pids`, wait up to `grace` seconds, then SIGKILL whatever is left."""
    alive = set(pids)
    for pid in list(alive):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            alive.discard(pid)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {pid for pid in alive if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)}
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _matches(name: str, prefix: str | None) -> bool:
    if prefix is None:
        return PREFIX_RE.match(name) is not None
    return name.startswith(prefix)


def leftovers(prefix: str | None = None) -> list[str]:
    """Everything a Topology with `prefix` (any kpx topology if None) left behind.

    Lists kpx network namespaces, host-side links, processes inside kpx namespaces (from
    ``ip netns pids``), processes started by a Topology (marked through their environment) and
    temporary directories. An empty list means a clean machine.
    """
    found: list[str] = []
    for ns in _netns_list():
        if _matches(ns, prefix):
            found.append(f"netns {ns}")
            found.extend(f"process {pid} in netns {ns}" for pid in _netns_pids(ns))
    for line in _run_ip(["-o", "link", "show"], check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if _matches(name, prefix):
                found.append(f"host link {name}")
    for pid, cmd in sorted(_marked_pids(prefix).items()):
        if not _is_zombie(pid):
            found.append(f"process {pid} started by a topology: {cmd}")
    tmp = Path("/tmp")
    found.extend(f"path {path}" for path in sorted(tmp.glob("kpx*")) if _matches(path.name, prefix))
    return found


def remove_leftovers(prefix: str) -> list[str]:
    """Remove what a Topology with `prefix` left when its process died without cleanup: kill
    the processes it started and those in its network namespaces, delete the namespaces and
    its temporary paths. Returns `leftovers(prefix)` afterwards (empty when clean)."""
    if not PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"not a topology prefix: {prefix!r}")
    _kill_pids(set(_marked_pids(prefix)) - {os.getpid()}, grace=2.0)
    for ns in _netns_list():
        if ns.startswith(prefix):
            _kill_pids(set(_netns_pids(ns)) - {os.getpid()}, grace=2.0)
            _run_ip(["netns", "del", ns], check=False)
    for path in Path("/tmp").glob(f"{prefix}*"):
        shutil.rmtree(path, ignore_errors=True)
    return leftovers(prefix)


def python_env(base: Mapping[str, str] | None = None, prefix: str | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) with the harness on PYTHONPATH and the kpx mark."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(HARNESS_DIR) not in paths:
        paths.insert(0, str(HARNESS_DIR))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if prefix is not None:
        env[ENV_MARK] = prefix
    return env


def wait_for_line(proc: subprocess.Popen[bytes], expected: str, timeout: float) -> None:
    """Read `proc`'s stdout until a line equal to `expected`; then drain it in the background.

    Raises TopologyError if the process exits or `timeout` seconds pass first.
    """
    if proc.stdout is None:
        raise TopologyError("wait_for_line needs stdout=PIPE")
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TopologyError(f"{proc.args!r}: no {expected!r} line within {timeout}s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            code = proc.wait(timeout=5)
            raise TopologyError(f"{proc.args!r} exited ({code}) before printing {expected!r}")
        buf += chunk
        lines = buf.split(b"\n")
        if any(line.strip() == expected.encode() for line in lines[:-1]):
            break
    threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()


def _drain(stream: IO[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        while stream.read(65536):
            pass
        stream.close()


# ---- process-wide registry: atexit and signal cleanup ------------------------------------------

_LIVE: set[Topology] = set()
_REGISTRY_LOCK = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_ATEXIT_REGISTERED = False
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def cleanup_all() -> None:
    """Clean up every Topology still alive in this process."""
    with _REGISTRY_LOCK:
        live = list(_LIVE)
    for topo in live:
        try:
            topo.cleanup()
        except Exception:
            log.exception("cleanup of topology %s failed", topo.prefix)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # Read the previous handler first: cleanup unregisters the topologies, which restores
    # (and forgets) the previous handlers.
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    cleanup_all()
    _restore_handlers()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(topo: Topology) -> None:
    global _ATEXIT_REGISTERED
    with _REGISTRY_LOCK:
        _LIVE.add(topo)
        if not _ATEXIT_REGISTERED:
            atexit.register(cleanup_all)
            _ATEXIT_REGISTERED = True
        if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue  # ignored (e.g. SIGINT in a background job): it stays ignored
            _PREVIOUS_HANDLERS[sig] = previous
            signal.signal(sig, _on_signal)


def _unregister(topo: Topology) -> None:
    with _REGISTRY_LOCK:
        _LIVE.discard(topo)
        if not _LIVE:
            _restore_handlers()


def _restore_handlers() -> None:
    with _REGISTRY_LOCK:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in _PREVIOUS_HANDLERS.items():
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        _PREVIOUS_HANDLERS.clear()


# ---- the topology ------------------------------------------------------------------------------


class Topology:
    """Nodes and pods in network namespaces on one shared L2 fabric; see the module docstring."""

    def __init__(
        self,
        service_cidrs: Sequence[str] = DEFAULT_SERVICE_CIDRS,
        prefix: str | None = None,
    ) -> None:
        self.prefix = prefix or f"kpx{secrets.token_hex(3)}"
        if not PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"prefix must look like kpx<6 hex>, got {self.prefix!r}")
        self.service_cidrs = [str(ipaddress.ip_network(c)) for c in service_cidrs]
        self.fabric_netns = f"{self.prefix}-fabric"
        self.fabric_bridge = f"{self.prefix}br"
        self.tmpdir = Path("/tmp") / self.prefix
        self.nodes: dict[str, Node] = {}
        self.pods: dict[str, Pod] = {}
        self.remote: set[str] = set()  # nodes whose netns is elsewhere (add_remote_node)
        self._netns: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._pod_ips: dict[str, int] = {}
        self._pod_counter = 0
        self._host_relays: dict[int, Path] = {}
        self._exposed: dict[int, Path] = {}  # node-side port -> unix socket of the host relay
        self._lock = threading.RLock()
        self._closed = False
        self._cleanup_hooks: list[Callable[[], object]] = []
        _register(self)

    # -- context manager

    def __enter__(self) -> Topology:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    # -- building

    def _check_open(self) -> None:
        if self._closed:
            raise TopologyError(f"topology {self.prefix} was cleaned up")

    def _add_netns(self, name: str, sysctls: Sequence[str]) -> None:
        self._netns.append(name)  # recorded first: a half-made netns still gets deleted
        _run_ip(["netns", "add", name])
        _run_ip(["link", "set", "lo", "up"], netns=name)
        if sysctls:
            self._sysctl(name, sysctls)

    def _sysctl(self, netns: str, settings: Sequence[str], check: bool = True) -> bool:
        res = subprocess.run(
            ["ip", "netns", "exec", netns, "sysctl", "-q", "-w", *settings],
            capture_output=True,
            text=True,
            check=False,
        )
        if check and res.returncode != 0:
            raise TopologyError(f"sysctl in {netns}: {res.stderr.strip()}")
        return res.returncode == 0

    def _ensure_fabric(self) -> None:
        if self.fabric_netns in self._netns:
            return
        self.tmpdir.mkdir(mode=0o700)
        self._add_netns(self.fabric_netns, ())
        # The fabric only bridges; it never needs to see bridged frames in netfilter.
        self._sysctl(self.fabric_netns, [f"{k}=0" for k in _BRIDGE_NF_SYSCTLS], check=False)
        ns = self.fabric_netns
        _run_ip(["link", "add", self.fabric_bridge, "type", "bridge", "mcast_snooping", "0"], ns)
        _run_ip(["link", "set", self.fabric_bridge, "up"], ns)

    def _enable_bridge_nf(self, netns: str) -> None:
        settings = [f"{k}=1" for k in _BRIDGE_NF_SYSCTLS]
        if self._sysctl(netns, settings, check=False):
            return
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True, check=False)
        if not self._sysctl(netns, settings, check=False):
            log.warning("bridge-nf-call-iptables is not available in %s", netns)

    def _new_node(self, name: str) -> Node:
        """The next node's addresses and names (the fabric made first); nothing of its own."""
        self._check_open()
        if not NAME_RE.fullmatch(name) or name in self.nodes:
            raise ValueError(f"bad or duplicate node name {name!r}")
        self._ensure_fabric()
        i = len(self.nodes) + 1
        if i > 250:
            raise TopologyError("at most 250 nodes")
        return Node(
            name=name,
            index=i,
            netns=f"{self.prefix}-n-{name}",
            ipv4=f"10.242.0.{i}",
            ipv6=f"fd00:242::{i:x}",
            pod_cidr_v4=f"10.244.{i}.0/24",
            pod_cidr_v6=f"fd00:244:{i:x}::/64",
            gateway_v4=f"10.244.{i}.1",
            gateway_v6=f"fd00:244:{i:x}::1",
            fabric_if=f"{self.prefix}f{i}",
        )

    def add_node(self, name: str, pod_hosts_from: int = 2) -> Node:
        """Create node `name`: its netns, fabric link, cbr0 and routes (in all nodes).
        `add_pod` gives its pods the addresses from host number `pod_hosts_from` of each pod
        CIDR on (a real node's CNI hands out those below)."""
        with self._lock:
            node = self._new_node(name)
            i = node.index
            ns = node.netns
            self._add_netns(ns, NODE_SYSCTLS)
            fabric_port = f"{self.prefix}n{i}"
            veth = ["link", "add", fabric_port, "type", "veth"]
            _run_ip([*veth, "peer", "name", node.fabric_if, "netns", ns], self.fabric_netns)
            _run_ip(["link", "set", fabric_port, "master", self.fabric_bridge], self.fabric_netns)
            _run_ip(["link", "set", fabric_port, "up"], self.fabric_netns)
            for args in node_link_commands(node, self.service_cidrs):
                _run_ip(args, ns)
            self._enable_bridge_nf(ns)
            for other in self.nodes.values():
                self._route_pods(node, other)
                if other.name not in self.remote:
                    self._route_pods(other, node)
            self.nodes[name] = node
            self._pod_ips[name] = pod_hosts_from - 1
            for node_port, sock in self._exposed.items():
                self._start_node_relay(node, node_port, sock)
            return node

    def add_remote_node(self, name: str) -> tuple[Node, str]:
        """Node `name` on the fabric whose netns lives elsewhere (a proxy-vm guest): its
        addresses as add_node gives them, a tap device `<prefix>t<i>` on the fabric bridge for
        its link (open it with `open_tap(self.fabric_netns, tap)`), and routes to its pod
        CIDRs in this host's nodes. The other side makes the node's netns from
        `node_link_commands` and `pod_routes`. Returns the Node and the tap's name."""
        with self._lock:
            node = self._new_node(name)
            i = node.index
            tap = f"{self.prefix}t{i}"
            _run_ip(["tuntap", "add", "dev", tap, "mode", "tap"], self.fabric_netns)
            _run_ip(["link", "set", tap, "master", self.fabric_bridge], self.fabric_netns)
            _run_ip(["link", "set", tap, "up"], self.fabric_netns)
            for other in self.nodes.values():
                if other.name not in self.remote:
                    self._route_pods(other, node)
            self.nodes[name] = node
            self.remote.add(name)
            return node, tap

    def pod_routes(self, node: Node) -> list[list[str]]:
        """`ip` arguments routing every other node's pod CIDRs from `node` (run in its netns)."""
        return [
            args
            for other in self.nodes.values()
            if other.name != node.name
            for args in (
                ["route", "replace", other.pod_cidr_v4, "via", other.ipv4],
                ["-6", "route", "replace", other.pod_cidr_v6, "via", other.ipv6],
            )
        ]

    @staticmethod
    def _route_pods(on: Node, to: Node) -> None:
        _run_ip(["route", "replace", to.pod_cidr_v4, "via", to.ipv4], on.netns)
        _run_ip(["-6", "route", "replace", to.pod_cidr_v6, "via", to.ipv6], on.netns)

    def add_pod(self, node: Node | str, name: str, routed: bool = False) -> Pod:
        """Create pod `name` on `node` with the next free IPv4/IPv6 of the node's pod CIDRs.

        `routed`: instead of a cbr0 port, the pod's veth is routed by the node (as CNIs
        without a bridge do): the node side is named `<prefix>r<n>` and holds the pod's
        gateways 169.254.1.1 and fe80::1, the node routes the pod's /32 and /128 to it."""
        with self._lock:
            self._check_open()
            node = self.nodes[node] if isinstance(node, str) else node
            if not NAME_RE.fullmatch(name) or name in self.pods:
                raise ValueError(f"bad or duplicate pod name {name!r}")
            n = self._pod_ips[node.name] + 1
            if n > 254:
                raise TopologyError(f"node {node.name} has no free pod address")
            self._pod_ips[node.name] = n
            self._pod_counter += 1
            v4net = ipaddress.ip_network(node.pod_cidr_v4)
            v6net = ipaddress.ip_network(node.pod_cidr_v6)
            pod = Pod(
                name=name,
                node=node,
                netns=f"{self.prefix}-p-{name}",
                ipv4=str(v4net.network_address + n),
                ipv6=str(v6net.network_address + n),
                host_if=f"{self.prefix}{'r' if routed else 'p'}{self._pod_counter}",
            )
            if len(pod.host_if) > IFNAMSIZ:
                raise TopologyError(f"interface name {pod.host_if} is too long")
            ns = pod.netns
            self._add_netns(ns, _COMMON_SYSCTLS)
            _run_ip(
                ["link", "add", pod.host_if, "type", "veth", "peer", "name", "eth0", "netns", ns],
                node.netns,
            )
            if routed:
                self._route_pod(pod)
                self.pods[name] = pod
                return pod
            _run_ip(["link", "set", pod.host_if, "master", "cbr0"], node.netns)
            hairpin = ["type", "bridge_slave", "hairpin", "on"]
            _run_ip(["link", "set", pod.host_if, *hairpin], node.netns)
            _run_ip(["link", "set", pod.host_if, "up"], node.netns)
            _run_ip(["addr", "add", f"{pod.ipv4}/{v4net.prefixlen}", "dev", "eth0"], ns)
            _run_ip(["addr", "add", f"{pod.ipv6}/{v6net.prefixlen}", "dev", "eth0", "nodad"], ns)
            _run_ip(["link", "set", "eth0", "up"], ns)
            _run_ip(["route", "add", "default", "via", node.gateway_v4], ns)
            _run_ip(["-6", "route", "add", "default", "via", node.gateway_v6], ns)
            self.pods[name] = pod
            return pod

    @staticmethod
    def _route_pod(pod: Pod) -> None:
        """Plumb a routed pod (see add_pod): no bridge, a host route per address."""
        node, ns, host_if = pod.node.netns, pod.netns, pod.host_if
        _run_ip(["addr", "add", "169.254.1.1/32", "dev", host_if], node)
        _run_ip(["addr", "add", "fe80::1/64", "dev", host_if, "nodad"], node)
        _run_ip(["link", "set", host_if, "up"], node)
        _run_ip(["route", "add", f"{pod.ipv4}/32", "dev", host_if], node)
        _run_ip(["-6", "route", "add", f"{pod.ipv6}/128", "dev", host_if], node)
        # Bridged pods see the whole pod CIDR on their link: the node answers for this one.
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                node,
                "sysctl",
                "-q",
                "-w",
                "net.ipv4.conf.cbr0.proxy_arp=1",
                "net.ipv6.conf.all.proxy_ndp=1",
            ],
            capture_output=True,
            check=True,
        )
        _run_ip(["-6", "neigh", "add", "proxy", pod.ipv6, "dev", "cbr0"], node)
        _run_ip(["addr", "add", f"{pod.ipv4}/32", "dev", "eth0"], ns)
        _run_ip(["addr", "add", f"{pod.ipv6}/128", "dev", "eth0", "nodad"], ns)
        _run_ip(["link", "set", "eth0", "up"], ns)
        _run_ip(["route", "add", "default", "via", "169.254.1.1", "dev", "eth0", "onlink"], ns)
        _run_ip(["-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0"], ns)

    # -- processes

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for processes we start: PYTHONPATH with the harness, plus the mark."""
        return python_env(base, self.prefix)

    def _netns_argv(self, target: Target, argv: Sequence[str]) -> list[str]:
        ns = netns_of(target)
        if ns not in self._netns:
            raise TopologyError(f"{ns!r} is not a netns of topology {self.prefix}")
        return ["ip", "netns", "exec", ns, *argv]

    def _spawn(self, argv: list[str], popen_kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
        with self._lock:
            self._check_open()
            popen_kwargs["env"] = self.env(popen_kwargs.get("env"))
            popen_kwargs["start_new_session"] = True  # so cleanup can kill the whole group
            proc: subprocess.Popen[Any] = subprocess.Popen(argv, **popen_kwargs)
            self._procs.append(proc)
            return proc

    def call(self, target: Target, fn: Callable[[], T]) -> T:
        """Run `fn` in a thread of this process inside the netns of `target`; return what it
        returns. Sockets `fn` opens live in that netns."""
        ns = netns_of(target)
        with self._lock:
            self._check_open()
            if ns not in self._netns:
                raise TopologyError(f"{ns!r} is not a netns of topology {self.prefix}")
        return call_in_netns(ns, fn)

    def run(
        self, target: Target, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start `argv` inside the netns of `target`; killed (whole process group) on cleanup."""
        return self._spawn(self._netns_argv(target, argv), popen_kwargs)

    def run_host(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in the host netns, tracked and killed on cleanup like `run`."""
        return self._spawn(list(argv), popen_kwargs)

    def run_ready(
        self,
        target: Target | None,
        argv: Sequence[str],
        ready: str = "ready",
        timeout: float = 15.0,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """`run` (or `run_host` if target is None), then wait for a `ready` line on stdout."""
        popen_kwargs["stdout"] = subprocess.PIPE
        if target is None:
            proc = self.run_host(argv, **popen_kwargs)
        else:
            proc = self.run(target, argv, **popen_kwargs)
        try:
            wait_for_line(proc, ready, timeout)
        except TopologyError:
            self._stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()
            raise
        return proc

    def python_argv(self, module: str, *args: str) -> list[str]:
        """argv running ``python -m module args...`` with this interpreter."""
        return [sys.executable, "-m", module, *args]

    def exec(
        self,
        target: Target,
        argv: Sequence[str],
        timeout: float = 30.0,
        check: bool = False,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the netns of `target` to completion; text stdout/stderr captured."""
        full = self._netns_argv(target, argv)
        proc = self._spawn(
            full,
            {
                "stdin": subprocess.PIPE if input is not None else subprocess.DEVNULL,
                "stdout": subprocess.PIPE,
                "stderr": subprocess.PIPE,
                "text": True,
            },
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop(proc, grace=0)
            proc.communicate()
            raise
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._procs.remove(proc)
        result = subprocess.CompletedProcess(full, proc.returncode, out, err)
        if check and result.returncode != 0:
            raise TopologyError(f"{full!r} exited {result.returncode}: {err.strip()}")
        return result

    @staticmethod
    def _stop(proc: subprocess.Popen[Any], grace: float = 3.0) -> None:
        """SIGTERM the process group of `proc`, SIGKILL it after `grace` seconds."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # The leader may be gone while its group lives on; its pid stays reserved until then.
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    # -- host port exposure

    def expose_host_port(self, host_port: int, node_port: int | None = None) -> None:
        """Make host 127.0.0.1:`host_port` reachable at 127.0.0.1:`node_port` in every node.

        A relay in the host netns listens on a unix socket under the topology's private
        (0700) temporary directory and connects to the host port; a relay in each node netns
        (current and future) listens on its loopback and connects to that unix socket. The
        relays copy bytes, so TLS passes through untouched.
        """
        node_port = host_port if node_port is None else node_port
        with self._lock:
            self._check_open()
            if node_port in self._exposed:
                if self._exposed[node_port] != self._host_relays.get(host_port):
                    raise TopologyError(f"node port {node_port} already exposes another port")
                return
            self._ensure_fabric()
            sock = self._host_relays.get(host_port)
            if sock is None:
                sock = self.tmpdir / f"host-{host_port}.sock"
                argv = self.python_argv("kpx_cluster.relay", "unix-to-tcp")
                argv += ["--unix", str(sock), "--to", f"127.0.0.1:{host_port}"]
                self.run_ready(None, argv)
                self._host_relays[host_port] = sock
            self._exposed[node_port] = sock
            for node in self.nodes.values():
                self._start_node_relay(node, node_port, sock)

    def _start_node_relay(self, node: Node, node_port: int, sock: Path) -> None:
        argv = self.python_argv("kpx_cluster.relay", "tcp-to-unix")
        argv += ["--listen", f"127.0.0.1:{node_port}", "--unix", str(sock)]
        self.run_ready(node, argv)

    # -- cleanup

    def on_cleanup(self, hook: Callable[[], object]) -> None:
        """Run `hook` first thing in `cleanup` (also on exit and on SIGTERM/SIGINT), once: for
        what the topology's users made beyond its processes (cgroups, a control plane)."""
        with self._lock:
            self._cleanup_hooks.append(hook)

    def cleanup(self) -> None:
        """Kill every process we started, delete every netns and temporary path. Idempotent."""
        with self._lock:
            hooks, self._cleanup_hooks = self._cleanup_hooks, []
            for hook in hooks:
                try:
                    hook()
                except Exception:
                    log.exception("a cleanup hook of topology %s failed", self.prefix)
            self._closed = True
            procs, self._procs = self._procs, []
            for proc in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 3.0
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            for proc in procs:
                self._stop(proc, grace=0)
            # Anything that escaped its process group: marked processes and netns residents.
            stray = set(_marked_pids(self.prefix))
            existing = set(_netns_list())
            for ns in self._netns:
                if ns in existing:
                    stray.update(_netns_pids(ns))
            stray.discard(os.getpid())
            _kill_pids(stray, grace=2.0)
            for ns in reversed(self._netns):
                if ns in existing:
                    _run_ip(["netns", "del", ns], check=False)
            self._netns.clear()
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            _unregister(self)

    def __repr__(self) -> str:
        return f"Topology(prefix={self.prefix!r}, nodes={list(self.nodes)}, pods={list(self.pods)})"
