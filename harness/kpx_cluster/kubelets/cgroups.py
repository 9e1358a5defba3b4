"""A node's cgroups: one top cgroup per node in every mounted hierarchy (v1 hybrid, as on this
machine; or the one unified v2 hierarchy, as in the proxy-vm guest), the kubelet's cgroupRoot.
The node's own processes (its supervisor, containerd and shims, the kubelet) run in
`<top>/runtime`; the kubelet puts pods under `<top>/kubepods`. So everything a node ever
started is in its top cgroup, and `remove` ends it all and leaves none.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
_CPUSET_FILES = ("cpuset.cpus", "cpuset.mems")


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy: v1 controllers, name=systemd and the v2 `unified` below
    /sys/fs/cgroup, or /sys/fs/cgroup itself when it is the one v2 hierarchy."""
    mounted = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0] if right else ""
        if fstype in ("cgroup", "cgroup2"):
            mount_point = Path(left.split()[4])
            if mount_point.parent == CGROUP_FS or mount_point == CGROUP_FS:
                mounted.add(mount_point)
    return sorted(mounted)


def _delegate(parent: Path) -> None:
    """cgroup v2: enable in `parent`'s children every controller `parent` has (the kubelet
    refuses a cgroupRoot lacking cpu, cpuset, memory or pids). A no-op in a v1 hierarchy."""
    controllers = parent / "cgroup.controllers"
    if not controllers.exists():
        return
    wanted = controllers.read_text().split()
    have = (parent / "cgroup.subtree_control").read_text().split()
    missing = [c for c in wanted if c not in have]
    if missing:
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))


def create(path: str) -> None:
    """mkdir `path` (relative, e.g. kpx1a2b3c-node-1/runtime) in every hierarchy; cpuset's
    cpus and mems are copied from the parent down (a v1 cpuset cgroup without them takes no
    process); in v2 each level delegates its controllers to the next."""
    for root in hierarchies():
        current = root
        for part in Path(path).parts:
            parent, current = current, current / part
            _delegate(parent)  # parents only: the leaf takes processes
            with contextlib.suppress(FileExistsError):
                current.mkdir()
            for name in _CPUSET_FILES:
                src, dst = parent / name, current / name
                if src.exists() and not dst.read_text().strip():
                    dst.write_text(src.read_text())


def join(path: str, pid: int = 0) -> None:
    """Move `pid` (0: the calling process) into `path` in every hierarchy."""
    pid = pid or os.getpid()
    for root in hierarchies():
        procs = root / path / "cgroup.procs"
        if procs.exists():
            procs.write_text(str(pid))


def _walk(top: Path) -> Iterator[Path]:
    """`top` and every cgroup below it, deepest first."""
    if not top.is_dir():
        return
    for entry in sorted(top.iterdir()):
        if entry.is_dir():
            yield from _walk(entry)
    yield top


def pids(top: str) -> set[int]:
    found: set[int] = set()
    for root in hierarchies():
        for cg in _walk(root / top):
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (cg / "cgroup.procs").read_text().split())
    return found


def remove(top: str, timeout: float = 20.0) -> list[str]:
    """SIGKILL every process under `top` (in any hierarchy) until none is left, then remove the
    cgroups deepest first. Returns what could not be removed (empty when clean)."""
    deadline = time.monotonic() + timeout
    while (left := pids(top)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    stuck: list[str] = []
    for root in hierarchies():
        for cg in _walk(root / top):
            for _ in range(50):
                try:
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last task exits
                    time.sleep(0.1)
            else:
                stuck.append(str(cg))
    return stuck


def leftovers(prefix: str) -> list[str]:
    """Top cgroups whose name starts with `prefix`, in any hierarchy."""
    return [str(p) for root in hierarchies() for p in sorted(root.glob(f"{prefix}*")) if p.is_dir()]
