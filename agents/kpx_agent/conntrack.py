"""Stale UDP conntrack entries, shared by every mode.

UDP has no connection teardown: when an endpoint goes away, clients keep sending into the
conntrack entry that still DNATs to it; when a Service goes from no endpoints to some, the
entries created while it was rejected or unrouted keep being used. Both blackhole the client
until the entry expires (the long-standing upstream bug class). After each successful sync the
agent deletes exactly those entries.

"Created while rejected or unrouted" are the entries that were not DNATed: their reply comes
from the address the client sent to (a ClusterIP, external or load-balancer IP), or from the
NodePort itself. An entry DNATed to a serving endpoint is a live flow and stays, as upstream
kube-proxy keeps it (pkg/proxy/conntrack/cleanup.go deletes only entries whose reply source is
not a serving endpoint). This matters on every agent start (a mode switch, an upgrade, a
restart): there every UDP port goes from "nothing known" to its endpoints, and deleting every
entry to its addresses dropped the replies of exchanges in flight (issue #18's load measured
one lost exchange in 4,300 on a mode switch). Not covered (upstream covers it by listing the
whole table at every sync): an entry DNATed to an endpoint that went away while no agent ran
on the node stays until it expires (nf_conntrack_udp_timeout, or _stream for a flow that was
answered).

`stale_flows` is pure; `delete_flows` is the I/O edge (the `conntrack` tool, argument lists).
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .localnet import IPAddress, Protocol, ServicePort

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class FlowFilter:
    """Delete UDP entries to `dst` (or to any address, for a NodePort) on `port`: only those
    DNATed to `dnat_to` (and, when `dnat_port` is set, to that port of it: the same pod with
    another targetPort is another endpoint, as upstream tells them apart), or with `not_nated`
    only those that were not DNATed (the reply comes from `dst` itself; for a NodePort, from
    `port` itself)."""

    family: int
    port: int
    dst: IPAddress | None = None
    dnat_to: IPAddress | None = None
    not_nated: bool = False
    dnat_port: int = 0

    def argv(self) -> list[str]:
        args = ["conntrack", "-D", "-f", "ipv4" if self.family == 4 else "ipv6", "-p", "udp"]
        if self.dst is not None:
            args += ["--orig-dst", str(self.dst)]
        args += ["--orig-port-dst", str(self.port)]
        if self.dnat_to is not None:
            args += ["--dst-nat", str(self.dnat_to)]
            if self.dnat_port:
                # A DNATed entry's reply comes from the endpoint's address and port.
                args += ["--reply-port-src", str(self.dnat_port)]
        if self.not_nated:
            # A NodePort entry DNATed to an endpoint whose port equals the NodePort is
            # deleted too (only the port tells them apart without the node's addresses).
            args += ["--reply-src", str(self.dst)] if self.dst is not None else [
                "--reply-port-src", str(self.port)]  # fmt: skip
        return args


def _targets(sp: ServicePort) -> list[tuple[IPAddress | None, int]]:
    vips: list[tuple[IPAddress | None, int]] = [
        (ip, sp.port) for ip in (*sp.cluster_ips, *sp.external_ips, *sp.load_balancer_ips)
    ]
    if sp.node_port:
        vips.append((None, sp.node_port))
    return vips


def _endpoints(sp: ServicePort | None) -> set[tuple[IPAddress, int]]:
    """The (address, port) pairs a port DNATs to: an endpoint is both (upstream's
    cleanup compares IP:port, so a targetPort change on the same pods is a change)."""
    if sp is None:
        return set()
    return {(e.ip, e.port) for e in (*sp.cluster_endpoints, *sp.external_endpoints)}


def stale_flows(old: ServicePort | None, new: ServicePort | None) -> list[FlowFilter]:
    """The conntrack deletions a change of one UDP service port calls for."""
    port = new or old
    if port is None or port.protocol is not Protocol.UDP:
        return []
    out: set[FlowFilter] = set()
    gone = _endpoints(old) - _endpoints(new)
    for ep, ep_port in gone:
        for dst, p in _targets(old or port):
            out.add(FlowFilter(port.family, p, dst, ep, dnat_port=ep_port))
    if new is not None and not _endpoints(old) and _endpoints(new):
        for dst, p in _targets(new):
            out.add(FlowFilter(port.family, p, dst, not_nated=True))
    return sorted(out, key=lambda f: (f.family, f.port, str(f.dst), str(f.dnat_to)))


#: Seconds one `conntrack -D` may take, and all of one sync's deletions together: the cleanup
#: runs after each sync, before the next one, so it must not hold the dataplane up.
CALL_TIMEOUT = 5.0
BUDGET = 30.0


#: Conntrack entries `delete_flows` deleted since the agent started, per IP family (as
#: conntrack reports them: "N flow entries have been deleted"): the metrics read it.
deleted_by_family: Counter[int] = Counter()
_DELETED = re.compile(r"(\d+) flow entr(?:y|ies) ha(?:ve|s) been deleted")


def delete_flows(filters: Iterable[FlowFilter], budget: float = BUDGET) -> int:
    """Run the deletions; returns how many failed (other than 'nothing matched'). Never
    raises: a `conntrack` tool that cannot be run (missing, no pid left) fails them all at
    once, and what the time budget leaves undone counts as failed; both are logged. The
    entries deleted are counted in `deleted_by_family`."""
    flows = list(filters)
    deadline = time.monotonic() + budget
    failures = 0
    for done, flow in enumerate(flows):
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("conntrack cleanup: %d deletions left undone after %.0f s",
                        len(flows) - done, budget)  # fmt: skip
            return failures + len(flows) - done
        try:
            proc = subprocess.run(flow.argv(), capture_output=True, text=True, check=False,
                                  timeout=min(CALL_TIMEOUT, left))  # fmt: skip
        except subprocess.TimeoutExpired:
            failures += 1
            log.warning("conntrack cleanup failed (%s): timed out", flow)
            continue
        except OSError as exc:
            log.warning("conntrack cleanup not done: cannot run conntrack (%s); %d deletions"
                        " left undone", exc, len(flows) - done)  # fmt: skip
            return failures + len(flows) - done
        if found := _DELETED.search(proc.stderr):
            deleted_by_family[flow.family] += int(found.group(1))
        # conntrack exits 1 with "0 flow entries have been deleted" when nothing matched.
        if proc.returncode != 0 and "0 flow entries" not in proc.stderr:
            failures += 1
            log.warning("conntrack cleanup failed (%s): %s", flow, proc.stderr.strip())
    return failures
