"""Stale UDP conntrack entries, shared by every mode.

UDP has no connection teardown: when an endpoint goes away, clients keep sending into the
conntrack entry that still DNATs to it; when a Service goes from no endpoints to some, the
entries created while it was rejected or unrouted keep being used. Both blackhole the client
until the entry expires (the long-standing upstream bug class). After each successful sync the
agent deletes exactly those entries.

`stale_flows` is pure; `delete_flows` is the I/O edge (the `conntrack` tool, argument lists).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from .localnet import IPAddress, Protocol, ServicePort

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class FlowFilter:
    """Delete UDP entries to `dst` (or to any address, for a NodePort) on `port`, optionally
    only those DNATed to `dnat_to`."""

    family: int
    port: int
    dst: IPAddress | None = None
    dnat_to: IPAddress | None = None

    def argv(self) -> list[str]:
        args = ["conntrack", "-D", "-f", "ipv4" if self.family == 4 else "ipv6", "-p", "udp"]
        if self.dst is not None:
            args += ["--orig-dst", str(self.dst)]
        args += ["--orig-port-dst", str(self.port)]
        if self.dnat_to is not None:
            args += ["--dst-nat", str(self.dnat_to)]
        return args


def _targets(sp: ServicePort) -> list[tuple[IPAddress | None, int]]:
    vips: list[tuple[IPAddress | None, int]] = [
        (ip, sp.port) for ip in (*sp.cluster_ips, *sp.external_ips, *sp.load_balancer_ips)
    ]
    if sp.node_port:
        vips.append((None, sp.node_port))
    return vips


def _endpoint_ips(sp: ServicePort | None) -> set[IPAddress]:
    if sp is None:
        return set()
    return {e.ip for e in (*sp.cluster_endpoints, *sp.external_endpoints)}


def stale_flows(old: ServicePort | None, new: ServicePort | None) -> list[FlowFilter]:
    """The conntrack deletions a change of one UDP service port calls for."""
    port = new or old
    if port is None or port.protocol is not Protocol.UDP:
        return []
    out: set[FlowFilter] = set()
    gone = _endpoint_ips(old) - _endpoint_ips(new)
    for ep in gone:
        for dst, p in _targets(old or port):
            out.add(FlowFilter(port.family, p, dst, ep))
    if new is not None and not _endpoint_ips(old) and _endpoint_ips(new):
        for dst, p in _targets(new):
            out.add(FlowFilter(port.family, p, dst))
    return sorted(out, key=lambda f: (f.family, f.port, str(f.dst), str(f.dnat_to)))


def delete_flows(filters: Iterable[FlowFilter]) -> int:
    """Run the deletions; returns how many failed (other than 'nothing matched')."""
    failures = 0
    for flow in filters:
        proc = subprocess.run(flow.argv(), capture_output=True, text=True, check=False)
        # conntrack exits 1 with "0 flow entries have been deleted" when nothing matched.
        if proc.returncode != 0 and "0 flow entries" not in proc.stderr:
            failures += 1
            log.warning("conntrack cleanup failed (%s): %s", flow, proc.stderr.strip())
    return failures
