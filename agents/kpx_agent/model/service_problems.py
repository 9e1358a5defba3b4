"""Problems of single Services that the agent leaves out of the dataplane, and their Events.

One bad Service must never stop the others from being programmed: whatever decides to leave a
Service (or part of one) out records a `ServiceProblem` here, under the name of the place that
decided it (a *source*: the node-local model for VIP clashes, the dataplane for what the kernel
refused, ...). Each source replaces its whole list after each decision, so a problem that is
fixed disappears by itself.

The agent reports each new problem once as a Warning Event on the Service. The Event's name is
derived from the problem (Service, reason, message), so when every node decides the same (a clash
is decided the same way everywhere) the first node's create wins and the others get
AlreadyExists: one Event per problem in the cluster, not one per node.

Pure: the agent (`agent.py`) posts what `ProblemBook.take_new` returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kpx_api.constants import AGENT_EVENT_SOURCE

#: Reasons (Event reasons, metric label values) of the problems the agent reports.
VIP_CLASH: Final = "VIPClash"
SOURCE_RANGES_UNUSABLE: Final = "LoadBalancerSourceRangesUnusable"
REFUSED_BY_KERNEL: Final = "RefusedByKernel"
QUARANTINED: Final = "Quarantined"
EXTERNAL_IP_REFUSED: Final = "ExternalIPRefused"


@dataclass(frozen=True, order=True)
class ServiceProblem:
    """One Service (namespace, name) the agent programs only in part, or not at all."""

    namespace: str
    name: str
    reason: str  # a CamelCase Event reason, one of the constants above
    message: str  # what was left out and why, for a person

    @property
    def service(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclass
class ProblemBook:
    """The problems each source found last, and which of them were already reported."""

    _by_source: dict[str, frozenset[ServiceProblem]] = field(default_factory=dict)
    _reported: set[ServiceProblem] = field(default_factory=set)

    def replace(self, source: str, problems: Iterable[ServiceProblem]) -> None:
        """`source`'s problems are now exactly these (an empty list clears them)."""
        found = frozenset(problems)
        if found:
            self._by_source[source] = found
        else:
            self._by_source.pop(source, None)

    def current(self) -> frozenset[ServiceProblem]:
        return frozenset().union(*self._by_source.values())

    def of(self, source: str) -> frozenset[ServiceProblem]:
        return self._by_source.get(source, frozenset())

    def take_new(self) -> list[ServiceProblem]:
        """Problems not reported yet (sorted); each is returned once while it lasts. A problem
        that goes away and comes back is new again."""
        now = self.current()
        self._reported &= now
        new = sorted(now - self._reported)
        self._reported |= now
        return new

    def counts(self) -> dict[str, int]:
        """How many Services have a problem, by reason (the metric)."""
        out: dict[str, int] = {}
        for problem in self.current():
            out[problem.reason] = out.get(problem.reason, 0) + 1
        return out


def event_name(problem: ServiceProblem) -> str:
    """A name that every node derives alike for the same problem (at most 253 characters:
    a Service name has at most 63)."""
    digest = hashlib.sha256(
        "\0".join((problem.namespace, problem.name, problem.reason, problem.message)).encode()
    ).hexdigest()[:16]
    return f"{problem.name}.kpx-{digest}"


def event_body(problem: ServiceProblem, node: str, now: datetime) -> dict[str, Any]:
    """A Warning core/v1 Event about the Service (pure)."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(problem), "namespace": problem.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Service",
            "name": problem.name,
            "namespace": problem.namespace,
        },
        "type": "Warning",
        "reason": problem.reason,
        "message": problem.message[:1024],
        "source": {"component": AGENT_EVENT_SOURCE, "host": node},
        "reportingComponent": AGENT_EVENT_SOURCE,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
