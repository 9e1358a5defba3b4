"""Where a kind lives in the REST API: one table of the built-in kinds kpx reads or writes.

`BUILTIN` (by kind) seeds every `Client`'s discovery cache, so a path of one of these kinds
needs no discovery request; a kind not in it (a CRD's, say) is found by discovery
(`Client.kind_path`). The operator takes its kinds from here and adds its own CRD's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from .request import object_path


def prefix_of(api_version: str) -> str:
    """/api/v1 for the core group, else /apis/<group>/<version>."""
    return f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"


@dataclass(frozen=True)
class Kind:
    api_version: str  # v1, apps/v1, ...
    kind: str
    plural: str
    namespaced: bool

    @property
    def prefix(self) -> str:
        return prefix_of(self.api_version)

    def path(self, name: str | None = None, namespace: str | None = None) -> str:
        """The object's path (the collection's without `name`); a namespaced kind needs a
        namespace, a cluster-scoped one ignores it."""
        if self.namespaced and not namespace:
            raise ValueError(f"{self.kind} is namespaced: a namespace is needed")
        return object_path(self.prefix, self.plural, name, namespace if self.namespaced else None)


BUILTIN: Final[Mapping[str, Kind]] = MappingProxyType(
    {
        k.kind: k
        for k in (
            Kind("v1", "ConfigMap", "configmaps", True),
            Kind("v1", "Event", "events", True),
            Kind("v1", "Namespace", "namespaces", False),
            Kind("v1", "Node", "nodes", False),
            Kind("v1", "Pod", "pods", True),
            Kind("v1", "Service", "services", True),
            Kind("v1", "ServiceAccount", "serviceaccounts", True),
            Kind("discovery.k8s.io/v1", "EndpointSlice", "endpointslices", True),
            Kind("apps/v1", "DaemonSet", "daemonsets", True),
            Kind("apps/v1", "Deployment", "deployments", True),
            Kind("coordination.k8s.io/v1", "Lease", "leases", True),
        )
    }
)
