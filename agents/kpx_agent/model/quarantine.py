"""What one Service may cost on a node (pure).

A Service's cost is the endpoints of each of its ports, added up (in one IP family: a port with
2,000 endpoints is 2,000; 100 such ports, 200,000). Every one of them is a map element, a
rule or a real server on every node, and the sync that programs them holds up every other
change on the node. A Service above MAX_SERVICE_COST in a family is quarantined: not
programmed in that family (what it had is removed), reported (Warning Event Quarantined on it,
kpx_service_problems), and programmed again as soon as it is back under the cap. For scale:
10,000 Services of 10 endpoints, a large cluster, cost 100,000 in all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from .service_problems import QUARANTINED, ServiceProblem
from .types import ServicePort

MAX_SERVICE_COST: Final = 100_000


def cost(port: ServicePort) -> int:
    """The endpoints one port programs (those of every traffic path, counted once)."""
    return len({*port.cluster_endpoints, *port.external_endpoints, *port.short_circuit_endpoints})


def _most(port: ServicePort) -> int:
    """An upper bound of `cost` (endpoints shared by the paths counted once per path), without
    building the set: every Service of a full sync is checked."""
    return (
        len(port.cluster_endpoints)
        + len(port.external_endpoints)
        + len(port.short_circuit_endpoints)
    )


def quarantine(
    namespace: str, name: str, ports: Iterable[ServicePort], cap: int = MAX_SERVICE_COST
) -> tuple[list[ServicePort], tuple[ServiceProblem, ...]]:
    """The ports to program (those of the families under the cap) and the problems of the
    families left out."""
    by_family: dict[int, list[ServicePort]] = {}
    for port in ports:
        by_family.setdefault(port.family, []).append(port)
    kept: list[ServicePort] = []
    problems: list[ServiceProblem] = []
    for family, family_ports in sorted(by_family.items()):
        if sum(_most(p) for p in family_ports) <= cap:
            kept.extend(family_ports)  # under the cap however many endpoints the paths share
            continue
        total = sum(cost(p) for p in family_ports)
        if total > cap:
            problems.append(
                ServiceProblem(
                    namespace,
                    name,
                    QUARANTINED,
                    f"IPv{family} not programmed on this node: {len(family_ports)} ports with "
                    f"{total:,} endpoints in all is over the cap of {cap:,} per Service "
                    '(docs/api.md, "What one Service may cost")',
                )
            )
        else:
            kept.extend(family_ports)
    return kept, tuple(problems)
