"""The operator's calls to the apiserver (besides kopf's own watches and patches), by kind.

Everything the operator writes goes through `ApiServer.apply`: server-side apply (PATCH
application/apply-patch+yaml, fieldManager kpx-operator, force), which creates missing objects,
repairs hand edits of the fields the operator owns and leaves other fields alone. Reads,
deletes, the status write and the Lease calls of the leader election are here too. The HTTP
client, its errors (`ApiError` and its subclasses) and the credentials (kubeconfig with exec
plugins, or in-cluster) are kpx_kube's; kopf's login handler uses the same `Credentials`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kpx_api.constants import GROUP, PLURAL, VERSION
from kpx_kube import ApiError, Client, Credentials, Reply, from_kubeconfig, in_cluster
from kpx_kube.request import object_path as rest_path

from .names import FIELD_MANAGER

__all__ = ["ApiError", "ApiServer", "Applied", "Credentials", "Reply", "from_kubeconfig",
           "in_cluster"]  # fmt: skip

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    prefix: str  # /api/v1 or /apis/<group>/<version>
    plural: str
    namespaced: bool


#: Every kind the operator reads or writes (no RBAC kinds: the agents' ServiceAccount, role and
#: binding are installed with the operator, which may not touch any role or binding).
KINDS: Final[dict[str, Kind]] = {
    "ConfigMap": Kind("/api/v1", "configmaps", True),
    "Pod": Kind("/api/v1", "pods", True),
    "Event": Kind("/api/v1", "events", True),
    "DaemonSet": Kind("/apis/apps/v1", "daemonsets", True),
    "Lease": Kind("/apis/coordination.k8s.io/v1", "leases", True),
    "ProxyConfiguration": Kind(f"/apis/{GROUP}/{VERSION}", PLURAL, False),
    # spec.takeover.moveKubeProxyOff: the label on Nodes, kube-system/kube-proxy's affinity.
    "Node": Kind("/api/v1", "nodes", False),
}


def object_path(kind: str, name: str | None = None, namespace: str | None = None) -> str:
    k = KINDS[kind]
    if k.namespaced and not namespace:
        raise ValueError(f"{kind} is namespaced: a namespace is needed")
    return rest_path(k.prefix, k.plural, name, namespace if k.namespaced else None)


# -- the client ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """The object as the apiserver returned it after an apply."""

    obj: Obj
    created: bool  # 201: the object did not exist before


class ApiServer:
    """The operator's calls, by kind and name, on kpx_kube's client: apply, get, list,
    delete, status patch, create/replace (Leases)."""

    def __init__(self, creds: Credentials, *, timeout: float = 30.0) -> None:
        self.creds = creds
        self.client = Client(creds, user_agent=FIELD_MANAGER, timeout=timeout, connections=8)

    async def close(self) -> None:
        await self.client.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Reply:
        """One request; (status, JSON body); raises the ApiError of a non-2xx status."""
        return await self.client.request(method, path, body=body, params=params)

    async def apply(self, obj: Mapping[str, Any]) -> Applied:
        """Server-side apply `obj` as kpx-operator, taking over conflicting fields (force)."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        status, out = await self.client.apply(path, obj, field_manager=FIELD_MANAGER, force=True)
        return Applied(out, created=status == 201)

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        """The object, or None when it does not exist."""
        return await self.client.get_or_none(object_path(kind, name, namespace))

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[Obj]:
        """The items of a list (one page: the operator lists only its own namespace's few)."""
        params = {k: v for k, v in (("labelSelector", label_selector),
                                    ("fieldSelector", field_selector)) if v}  # fmt: skip
        out = await self.client.get(object_path(kind, None, namespace), params)
        return list(out.get("items") or [])

    async def delete(
        self,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
    ) -> bool:
        """Delete; True when the object existed (and is now gone or going)."""
        return await self.client.delete(object_path(kind, name, namespace),
                                        propagation=propagation, missing_ok=True)  # fmt: skip

    async def patch(
        self, kind: str, name: str, namespace: str | None, body: Mapping[str, Any]
    ) -> Obj:
        """JSON merge patch of an object the operator does not own (a Node's label, the
        kube-proxy DaemonSet's affinity): only the fields in `body` change."""
        return await self.client.patch(object_path(kind, name, namespace), body)

    async def patch_status(self, kind: str, name: str, status: Mapping[str, Any]) -> Obj:
        """JSON merge patch of .status through the status subresource."""
        return await self.client.patch_status(object_path(kind, name), status)

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        return await self.client.create(object_path(str(obj["kind"]), None,
                                                    meta.get("namespace")), obj)  # fmt: skip

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT: fails with Conflict when metadata.resourceVersion is stale."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        return await self.client.replace(path, obj)
