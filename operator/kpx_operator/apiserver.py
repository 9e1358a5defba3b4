"""The operator's calls to the apiserver (besides kopf's own watches and patches), by kind.

Everything the operator writes goes through `ApiServer.apply`: server-side apply (PATCH
application/apply-patch+yaml, fieldManager kpx-operator, force), which creates missing objects,
repairs hand edits of the fields the operator owns and leaves other fields alone. Reads,
deletes, the status write and the Lease calls of the leader election are here too. The HTTP
client, its errors (`ApiError` and its subclasses) and the credentials (kubeconfig with exec
plugins, or in-cluster) are kpx_kube's; kopf's login handler uses the same `Credentials`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kpx_api.constants import GROUP, PLURAL, VERSION
from kpx_api.nodestate import NODE_STATE_KIND, NODE_STATE_PLURAL
from kpx_kube import ApiError, Client, Credentials, Reply, from_kubeconfig, in_cluster
from kpx_kube.kinds import BUILTIN, Kind

from .names import FIELD_MANAGER

__all__ = [
    "ApiError",
    "ApiServer",
    "Applied",
    "Credentials",
    "NotLeader",
    "Reply",
    "from_kubeconfig",
    "in_cluster",
]

Obj = dict[str, Any]
T = TypeVar("T")


class NotLeader(ApiError):
    """A write refused before it was sent: this replica's leadership ran out (leader.py)."""

    def __init__(self, what: str) -> None:
        super().__init__(0, "NotLeader", f"not the leader any more: {what} not written")


#: Every kind the operator reads or writes (no RBAC kinds: the agents' ServiceAccount, role and
#: binding are installed with the operator, which may not touch any role or binding): kpx_kube's
#: table of the built-in kinds, and the operator's own CRD.
KINDS: Final[dict[str, Kind]] = {
    **{k: BUILTIN[k] for k in ("ConfigMap", "Pod", "Event", "DaemonSet", "Lease")},
    # The apiserver's own addresses for the agents (default/kubernetes, get only).
    "EndpointSlice": BUILTIN["EndpointSlice"],
    "ProxyConfiguration": Kind(f"{GROUP}/{VERSION}", "ProxyConfiguration", PLURAL, False),
    # The agents' reports on their nodes: preflight, takeover, switch of mode, conntrack.
    "ProxyNodeState": Kind(f"{GROUP}/{VERSION}", NODE_STATE_KIND, NODE_STATE_PLURAL, False),
    # spec.takeover.moveKubeProxyOff: the label on Nodes, kube-system/kube-proxy's affinity.
    "Node": BUILTIN["Node"],
}


def object_path(kind: str, name: str | None = None, namespace: str | None = None) -> str:
    return KINDS[kind].path(name, namespace)


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
        #: With leader election: the seconds this replica may still write
        #: (`LeaderElector.lease_left`). Every write but the Lease's own is refused (NotLeader)
        #: once it is 0, and cut off when it runs out in flight. None: no election, no fence.
        self.fence: Callable[[], float] | None = None

    async def _write(self, kind: str, what: str, call: Awaitable[T]) -> T:
        if self.fence is None or kind == "Lease":
            return await call
        left = self.fence()
        if left <= 0:
            if asyncio.iscoroutine(call):
                call.close()  # never started: nothing was sent
            raise NotLeader(f"{kind} {what}")
        try:
            return await asyncio.wait_for(call, left)
        except TimeoutError:
            raise NotLeader(f"{kind} {what} (cut off in flight)") from None

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
        call = self.client.request(method, path, body=body, params=params)
        if method in ("GET", "HEAD"):
            return await call
        return await self._write("request", f"{method} {path}", call)

    async def apply(self, obj: Mapping[str, Any]) -> Applied:
        """Server-side apply `obj` as kpx-operator, taking over conflicting fields (force)."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        call = self.client.apply(path, obj, field_manager=FIELD_MANAGER, force=True)
        status, out = await self._write(str(obj["kind"]), meta["name"], call)
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
        params = {
            k: v
            for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if v
        }
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
        path = object_path(kind, name, namespace)
        call = self.client.delete(path, propagation=propagation, missing_ok=True)
        return await self._write(kind, name, call)

    async def patch(
        self, kind: str, name: str, namespace: str | None, body: Mapping[str, Any]
    ) -> Obj:
        """JSON merge patch of an object the operator does not own (a Node's label, the
        kube-proxy DaemonSet's affinity): only the fields in `body` change."""
        call = self.client.patch(object_path(kind, name, namespace), body)
        return await self._write(kind, name, call)

    async def patch_status(self, kind: str, name: str, status: Mapping[str, Any]) -> Obj:
        """JSON merge patch of .status through the status subresource."""
        call = self.client.patch_status(object_path(kind, name), status)
        return await self._write(kind, f"{name} status", call)

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), None, meta.get("namespace"))
        name = str(meta.get("name") or meta.get("generateName"))
        return await self._write(str(obj["kind"]), name, self.client.create(path, obj))

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT: fails with Conflict when metadata.resourceVersion is stale."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        return await self._write(str(obj["kind"]), meta["name"], self.client.replace(path, obj))
