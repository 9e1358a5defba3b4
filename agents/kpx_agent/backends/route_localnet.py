"""net.ipv4.conf.all.route_localnet, which localhost NodePorts need: with it, packets DNATed
from 127.0.0.0/8 may leave the node (and packets to 127.0.0.0/8 may arrive from outside it,
which each backend's martian guard drops). Shared by the iptables and nftables backends (the
sysctl is the kernel's, not a mode's); a pod is told where the node's file is mounted
(`--route-localnet-file`, since its own /proc/sys is read-only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: net.ipv4.conf.all.route_localnet of the agent's network namespace.
ROUTE_LOCALNET_FILE = Path("/proc/sys/net/ipv4/conf/all/route_localnet")

EnsureSysctl = Callable[[Path, int], None]


def ensure_sysctl(target: Path, value: int) -> None:
    """Set the sysctl file `target` to `value` if it differs, logging the change; OSError when
    it cannot be read or written."""
    current = target.read_text().strip()
    if current != str(value):
        target.write_text(f"{value}\n")
        log.info("set %s to %d (was %s)", target, value, current)


def allow(target: Path, setting: str, ensure: EnsureSysctl = ensure_sysctl) -> bool:
    """route_localnet=1 in `target`. Without it, localhost NodePorts do not answer: logged
    (naming the mode's `setting`), and False; the caller programs the rest of its rules."""
    try:
        ensure(target, 1)
    except OSError as exc:
        log.error(
            "localhostNodePorts: cannot set %s to 1 (%s): NodePorts on 127.0.0.1 will not"
            " answer; set it on the node, or set %s: false",
            target,
            exc,
            setting,
        )
        return False
    return True
