"""The node's conntrack table size and timeouts (spec.conntrack), set as upstream kube-proxy does.

- nf_conntrack_max = max(maxPerCore x the node's CPUs, min), the product capped at 1,048,576
  (upstream's cap); written only when the current value is lower (never lowered), and the
  nf_conntrack module's hashsize raised to nf_conntrack_max / 4 when it is smaller.
  maxPerCore 0 leaves both alone.
- nf_conntrack_tcp_timeout_established, _tcp_timeout_close_wait, _udp_timeout,
  _udp_timeout_stream: written when they differ; 0s leaves them alone.
- nf_conntrack_tcp_be_liberal: set to 1 when tcpBeLiberal is true; false leaves it alone.

`wanted` and `plan` are pure (settings and current values in, writes out); `apply` is the thin
I/O edge: it reads the current values under `ConntrackPaths`, writes what the plan says, logs
each change and returns what failed instead of raising. The timeouts are per network
namespace; nf_conntrack_max and hashsize are global to the host and only writable from its
network namespace: elsewhere the kernel shows nf_conntrack_max read-only (mode 0444) and
refuses hashsize. The agent takes that mode as the kernel's word: where nf_conntrack_max is
read-only (an agent in a test's node namespace, not a hostNetwork pod) it writes neither,
and reports a raise they would need as not applied.

Unlike the UDP flow cleanup in `conntrack.py`, this runs at start and on a configuration
reload, not on every sync.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kpx_api.durations import parse_duration
from kpx_api.proxysettings import Conntrack

log = logging.getLogger(__name__)

#: Upstream's cap on maxPerCore x CPUs (avoids huge tables on machines with many cores).
MAX_CAP: Final = 1_048_576

MAX: Final = "nf_conntrack_max"
HASHSIZE: Final = "hashsize"  # the nf_conntrack module parameter, not a sysctl
TCP_ESTABLISHED: Final = "nf_conntrack_tcp_timeout_established"
TCP_CLOSE_WAIT: Final = "nf_conntrack_tcp_timeout_close_wait"
TCP_BE_LIBERAL: Final = "nf_conntrack_tcp_be_liberal"
UDP: Final = "nf_conntrack_udp_timeout"
UDP_STREAM: Final = "nf_conntrack_udp_timeout_stream"

#: Where the node's values live (the agent's --conntrack-sysctl-dir / --conntrack-hashsize-file
#: point elsewhere when the pod mounts the node's directories at other paths).
DEFAULT_SYSCTL_DIR: Final = Path("/proc/sys/net/netfilter")
DEFAULT_HASHSIZE_FILE: Final = Path("/sys/module/nf_conntrack/parameters/hashsize")
CPU_ONLINE_FILE: Final = Path("/sys/devices/system/cpu/online")


def conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """The nf_conntrack_max to have (0: leave it alone), as upstream's getConntrackMax."""
    if max_per_core <= 0:
        return 0
    scaled = max_per_core * cpus
    if scaled > MAX_CAP:
        return MAX_CAP
    return max(scaled, minimum)


def _seconds(duration: str) -> int:
    return int(parse_duration(duration))


def wanted(conntrack: Conntrack, cpus: int) -> dict[str, int]:
    """Setting -> value for every setting the configuration asks for (leave-alone ones are
    absent). nf_conntrack_max brings the module's hashsize (max / 4) with it."""
    out: dict[str, int] = {}
    if limit := conntrack_max(conntrack.max_per_core, conntrack.min, cpus):
        out[MAX] = limit
        out[HASHSIZE] = limit // 4
    for name, duration in (
        (TCP_ESTABLISHED, conntrack.tcp_established_timeout),
        (TCP_CLOSE_WAIT, conntrack.tcp_close_wait_timeout),
        (UDP, conntrack.udp_timeout),
        (UDP_STREAM, conntrack.udp_stream_timeout),
    ):
        if seconds := _seconds(duration):
            out[name] = seconds
    if conntrack.tcp_be_liberal:
        out[TCP_BE_LIBERAL] = 1
    return out


def manages_node(conntrack: Conntrack) -> bool:
    """Whether the configuration asks the agent to change anything on the node (False: every
    setting is at its leave-alone value, and the agent needs no access to the node's values).
    The operator decides the pod's access by the same rule (Conntrack.leaves_node_alone)."""
    return not conntrack.leaves_node_alone()


def manages_hashsize(conntrack: Conntrack) -> bool:
    """Whether the agent may need to raise the nf_conntrack module's hashsize."""
    return conntrack.max_per_core > 0


@dataclass(frozen=True)
class Write:
    """One value to write: `setting` from `current` (None: unreadable) to `value`."""

    setting: str
    value: int
    current: int | None


#: Values that are only ever raised (upstream: a larger table set by the admin stays).
_RAISE_ONLY: Final = frozenset({MAX, HASHSIZE})


def plan(want: Mapping[str, int], current: Mapping[str, int | None]) -> list[Write]:
    """The writes that bring `current` to `want`: nf_conntrack_max and hashsize only when they
    are lower (or unreadable), the others when they differ; in a stable order (the table size
    before its hash size, as upstream)."""
    writes = []
    for setting, value in want.items():
        now = current.get(setting)
        if now is None or (now < value if setting in _RAISE_ONLY else now != value):
            writes.append(Write(setting, value, now))
    return writes


# -- the I/O edge ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConntrackPaths:
    """Where the agent reads and writes the node's values."""

    sysctl_dir: Path = DEFAULT_SYSCTL_DIR
    hashsize_file: Path = DEFAULT_HASHSIZE_FILE

    def of(self, setting: str) -> Path:
        return self.hashsize_file if setting == HASHSIZE else self.sysctl_dir / setting


@dataclass(frozen=True)
class Outcome:
    """What an apply did: the writes made, and one message per setting it could not apply."""

    changed: tuple[Write, ...] = ()
    failures: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failures


def parse_cpu_list(text: str) -> int:
    """CPUs in a kernel CPU list (``0-3,8,10-11`` -> 7)."""
    count = 0
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def node_cpus(online: Path = CPU_ONLINE_FILE) -> int:
    """The node's online CPUs (nf_conntrack_max is host-wide: not the process's cpuset, as
    upstream), else os.cpu_count()."""
    try:
        return max(1, parse_cpu_list(online.read_text()))
    except (OSError, ValueError):
        return os.cpu_count() or 1


def _write(path: Path, value: int) -> None:
    """Write an existing sysctl or parameter file; never create one (a missing file means
    the nf_conntrack module is not loaded, or the node's directory is not what was mounted)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


def _read(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


#: Global to the host (not per network namespace).
GLOBAL: Final = frozenset({MAX, HASHSIZE})


def globals_writable(paths: ConntrackPaths) -> bool:
    """Whether the kernel lets this process set the host-global values: nf_conntrack_max is
    writable (0644) only in the host's network namespace, read-only (0444) in any other.
    True when it cannot be told (a missing file fails on its own)."""
    try:
        return bool(paths.of(MAX).stat().st_mode & 0o222)
    except OSError:
        return True


def apply(
    conntrack: Conntrack,
    paths: ConntrackPaths,
    cpus: int | None = None,
    host_netns: bool | None = None,
) -> Outcome:
    """Read the node's values, write what differs, log each change; never raises."""
    want = wanted(conntrack, node_cpus() if cpus is None else cpus)
    if not want:
        return Outcome()
    current = {setting: _read(paths.of(setting)) for setting in want}
    host = globals_writable(paths) if host_netns is None else host_netns
    changed, failures = [], []
    for write in plan(want, current):
        path = paths.of(write.setting)
        if write.setting in GLOBAL and not host:
            failures.append(
                f"{write.setting}: wants {write.value} (now {write.current}), but it is global "
                "to the host and read-only here: this agent is not in the host's network "
                "namespace"
            )
            log.error("conntrack: %s", failures[-1])
            continue
        try:
            _write(path, write.value)
        except OSError as exc:
            before = "unreadable" if write.current is None else str(write.current)
            failures.append(
                f"{write.setting}: cannot set {write.value} (now {before}) at {path}: "
                f"{exc.strerror or exc}"
            )
            log.error("conntrack: %s", failures[-1])
            continue
        changed.append(write)
        log.info("conntrack: set %s to %d (was %s)", write.setting, write.value, write.current)
    return Outcome(tuple(changed), tuple(failures))
