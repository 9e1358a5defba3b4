"""Who owns a VIP: the clash rule for two Services that answer on one address, port and protocol.

A VIP (address, protocol, port) can be claimed by several service ports: a Service's ClusterIP,
a load balancer's ingress IP, a Service's externalIPs entry (CVE-2020-8554: anyone who may
create a Service may name another Service's ClusterIP as an external IP). Exactly one claim
is programmed, decided alike on every node and after every restart, whatever order the
Services arrive in:

1. a ClusterIP wins over a load-balancer ingress IP, which wins over an external IP;
2. between claims of one kind, the older Service (metadata.creationTimestamp) wins;
3. then the Service whose namespace/name (then port name) sorts first.

The loser keeps everything else (its other addresses and ports); only the clashing address is
left out of its port, and reported. The claims are an index VIP -> claimants, updated one
service port at a time, so a partial sync costs the claims of the ports it changes; when a
VIP's winner changes (it went away, or an older claim came), every claimant of that VIP is
resolved again.

Pure: the proxier feeds it the model's ports and programs what `resolve` returns.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from datetime import datetime
from typing import NamedTuple

from .service_problems import VIP_CLASH, ServiceProblem
from .types import IPAddress, Protocol, ServicePort, ServicePortKey


class VipKind(enum.IntEnum):
    """What a claim is, in the order of precedence (lower wins)."""

    CLUSTER_IP = 0
    LOAD_BALANCER_IP = 1
    EXTERNAL_IP = 2

    @property
    def label(self) -> str:
        return {0: "ClusterIP", 1: "load-balancer ingress IP", 2: "externalIP"}[self.value]


class Vip(NamedTuple):
    address: IPAddress
    protocol: Protocol
    port: int

    def __str__(self) -> str:
        address = f"[{self.address}]" if self.address.version == 6 else self.address
        return f"{address}:{self.port}/{self.protocol.value}"


class Claim(NamedTuple):
    """One service port's claim on one VIP; claims order by precedence (the least wins)."""

    kind: VipKind
    created: float  # the Service's creationTimestamp (seconds); unknown: newest of all
    key: ServicePortKey


_UNKNOWN_AGE = float("inf")


def creation_time(value: object) -> float:
    """metadata.creationTimestamp in seconds since the epoch; an absent or unreadable one
    counts as the newest (it never beats a Service with a known age)."""
    if not isinstance(value, str) or not value:
        return _UNKNOWN_AGE
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return _UNKNOWN_AGE


def _vips(sp: ServicePort) -> Iterator[tuple[Vip, VipKind]]:
    proto, port = sp.protocol, sp.port
    for ip in sp.cluster_ips:
        yield Vip(ip, proto, port), VipKind.CLUSTER_IP
    for ip in sp.load_balancer_ips:
        yield Vip(ip, proto, port), VipKind.LOAD_BALANCER_IP
    for ip in sp.external_ips:
        yield Vip(ip, proto, port), VipKind.EXTERNAL_IP


def _service(key: ServicePortKey) -> str:
    return f"{key.namespace}/{key.name}"


class VipClaims:
    """The index VIP -> claimants, and each port's claims."""

    def __init__(self) -> None:
        self._claimants: dict[Vip, dict[ServicePortKey, Claim]] = {}
        self._claims_of: dict[ServicePortKey, tuple[Vip, ...]] = {}

    def update(
        self, key: ServicePortKey, port: ServicePort | None, created: float = _UNKNOWN_AGE
    ) -> set[ServicePortKey]:
        """The port `key` now claims the VIPs of `port` (None: nothing). Returns the ports to
        resolve again: this one, and every claimant of a contested VIP it claimed before or
        claims now (their winner may have changed)."""
        affected = {key}
        for vip in self._claims_of.pop(key, ()):
            claimants = self._claimants[vip]
            if len(claimants) > 1:
                affected.update(claimants)
            del claimants[key]
            if not claimants:
                del self._claimants[vip]
        if port is None:
            return affected
        mine: dict[Vip, Claim] = {}
        for vip, kind in _vips(port):
            claim = Claim(kind, created, key)
            if vip not in mine or claim < mine[vip]:
                mine[vip] = claim  # a port naming one address twice claims it once, best kind
        for vip, claim in mine.items():
            claimants = self._claimants.setdefault(vip, {})
            claimants[key] = claim
            if len(claimants) > 1:
                affected.update(claimants)
        if mine:
            self._claims_of[key] = tuple(mine)
        return affected

    def winner(self, vip: Vip) -> Claim | None:
        claimants = self._claimants.get(vip)
        return min(claimants.values()) if claimants else None

    def resolve(self, port: ServicePort) -> tuple[ServicePort, tuple[ServiceProblem, ...]]:
        """The port as it is programmed: without the VIPs another port won, and the problems
        that describe them (none, and the same port, in the usual case)."""
        key = port.key
        lost: set[tuple[VipKind, IPAddress]] = set()
        problems: list[ServiceProblem] = []
        for vip, kind in _vips(port):
            claimants = self._claimants.get(vip)
            if claimants is None or len(claimants) < 2:
                continue
            best = min(claimants.values())
            if best.key == key:
                continue
            lost.add((kind, vip.address))
            problems.append(
                ServiceProblem(
                    key.namespace,
                    key.name,
                    VIP_CLASH,
                    f"{kind.label} {vip} is not programmed: Service {_service(best.key)} "
                    f"claims it as its {best.kind.label}, which takes precedence "
                    "(ClusterIP, then load-balancer ingress IP, then externalIP; then the "
                    "older Service; then namespace/name)",
                )
            )
        if not lost:
            return port, ()

        def kept(kind: VipKind, ips: tuple[IPAddress, ...]) -> tuple[IPAddress, ...]:
            return tuple(ip for ip in ips if (kind, ip) not in lost)

        resolved = dataclasses.replace(
            port,
            cluster_ips=kept(VipKind.CLUSTER_IP, port.cluster_ips),
            load_balancer_ips=kept(VipKind.LOAD_BALANCER_IP, port.load_balancer_ips),
            external_ips=kept(VipKind.EXTERNAL_IP, port.external_ips),
        )
        return resolved, tuple(sorted(set(problems)))
