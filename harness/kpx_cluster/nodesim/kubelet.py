"""One simulated kubelet: registers its Node, renews its Lease, runs the pods bound to it.

Everything goes through the node's own credentials (``system:node:<name>``), so what the Node
authorizer and NodeRestriction refuse a kubelet is refused here too. The only exception: node
labels a kubelet may not set on itself (NodeRestriction) are added with the admin identity
afterwards, the way a cluster administrator would, and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..binaries import KUBERNETES_VERSION
from ..netns import Node, Topology
from .api import ApiError, Credentials, KubeApi, Obj, now_micro, now_rfc3339
from .pod import NodeContext, PodWorker
from .relay import ApiRelays
from .runc import RuncRuntime
from .volumes import ObjectCache, TokenCache

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION = 40
LEASE_RENEW = 10.0
WATCH_TIMEOUT = 290
RELIST_DELAY = 1.0
STOP_GRACE = 1.0
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
CAPACITY = {"cpu": "4", "memory": "8Gi", "pods": "110", "ephemeral-storage": "100Gi"}

# NodeRestriction: a node may set labels outside kubernetes.io / k8s.io freely, and only these
# inside them (plus anything under kubelet.kubernetes.io/ and node.kubernetes.io/).
_KUBELET_LABELS = {
    "kubernetes.io/hostname",
    "kubernetes.io/arch",
    "kubernetes.io/os",
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
}


def kubelet_may_set(label: str) -> bool:
    """Whether NodeRestriction lets a node set `label` on its own Node object."""
    if label in _KUBELET_LABELS:
        return True
    domain = label.split("/", 1)[0] if "/" in label else ""
    if domain.startswith(("kubelet.kubernetes.io", "node.kubernetes.io")):
        return True
    restricted = ("kubernetes.io", "k8s.io")
    return not any(domain == d or domain.endswith("." + d) for d in restricted)


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


class Kubelet:
    """The kubelet of one simulated node; lives on the simulator's event loop."""

    def __init__(
        self,
        topology: Topology,
        node: Node,
        kubeconfig: Path,
        node_dir: Path,
        base_env: dict[str, str],
        labels: Mapping[str, str],
        taints: Sequence[Obj] = (),
        admin: KubeApi | None = None,
        relays: ApiRelays | None = None,
        runc: RuncRuntime | None = None,
    ) -> None:
        self.node = node
        self.name = node.name
        self.api = KubeApi(
            Credentials.from_kubeconfig(kubeconfig), f"kubelet/{KUBERNETES_VERSION} (nodesim)"
        )
        self.admin = admin
        self.labels = dict(labels)
        self.taints = list(taints)
        self.ctx = NodeContext(
            topology=topology,
            node=node,
            api=self.api,
            objects=ObjectCache(self.api),
            tokens=TokenCache(self.api),
            node_dir=node_dir,
            base_env=base_env,
            relays=relays,
            runc=runc,
        )
        self.pods: dict[str, PodWorker] = {}
        self._finished: set[str] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self._node_uid = ""

    # -- node registration -------------------------------------------------------------------

    async def start(self) -> None:
        """Register the Node, report it Ready, take the Lease; then watch pods."""
        await self._register()
        await self._post_status()
        await self._untaint_not_ready()
        await self._renew_lease()
        self._tasks.append(asyncio.create_task(self._lease_loop(), name=f"lease-{self.name}"))
        self._tasks.append(asyncio.create_task(self._pod_loop(), name=f"pods-{self.name}"))

    @property
    def refused(self) -> list[str]:
        """Requests the apiserver refused this node (403), for reports."""
        return self.ctx.refused

    def _note_refusal(self, err: ApiError) -> None:
        self.ctx.note_refusal(err)

    async def _register(self) -> None:
        own = {k: v for k, v in self.labels.items() if kubelet_may_set(k)}
        extra = {k: v for k, v in self.labels.items() if k not in own}
        spec: Obj = {
            "podCIDR": self.node.pod_cidr_v4,
            "podCIDRs": [self.node.pod_cidr_v4, self.node.pod_cidr_v6],
        }
        if self.taints:
            spec["taints"] = self.taints
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": own},
            "spec": spec,
        }
        try:
            created = await self.api.request("POST", "/api/v1/nodes", body=body)
        except ApiError as err:
            if err.status != 409:
                self._note_refusal(err)
                raise
            path = f"/api/v1/nodes/{self.name}"
            created = await self.api.request(
                "PATCH", path, body={"metadata": {"labels": own}}, patch="merge"
            )
            if created["spec"].get("podCIDRs") != spec["podCIDRs"]:
                log.warning(
                    "node %s existed with podCIDRs %s", self.name, created["spec"].get("podCIDRs")
                )
        self._node_uid = created["metadata"]["uid"]
        if extra:
            if self.admin is None:
                raise ValueError(f"labels {sorted(extra)} need an admin (NodeRestriction)")
            log.info(
                "node %s: labels %s set as admin (a kubelet may not)", self.name, sorted(extra)
            )
            path = f"/api/v1/nodes/{self.name}"
            await self.admin.request(
                "PATCH", path, body={"metadata": {"labels": extra}}, patch="merge"
            )

    def _node_status(self) -> Obj:
        now = now_rfc3339()

        def condition(kind: str, status: str, reason: str, message: str) -> Obj:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        uname = os.uname()
        return {
            "addresses": [
                {"type": "InternalIP", "address": self.node.ipv4},
                {"type": "InternalIP", "address": self.node.ipv6},
                {"type": "Hostname", "address": self.name},
            ],
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "simulated"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "simulated"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "simulated"),
                condition(
                    "Ready",
                    "True",
                    "KubeletReady",
                    "kubelet is posting ready status (node simulator)",
                ),
            ],
            "capacity": dict(CAPACITY),
            "allocatable": dict(CAPACITY),
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, self.name)),
                "bootID": str(uuid.uuid4()),
                "kernelVersion": uname.release,
                "osImage": "kpx node simulator",
                "containerRuntimeVersion": "sim://0.1.0",
                "kubeletVersion": KUBERNETES_VERSION,
                "operatingSystem": "linux",
                "architecture": _arch(),
            },
        }

    async def _post_status(self) -> None:
        path = f"/api/v1/nodes/{self.name}/status"
        try:
            await self.api.request(
                # A merge patch replaces lists whole: a strategic one merges addresses by type,
                # which breaks on two InternalIPs (v4 and v6) already present (re-registration).
                "PATCH",
                path,
                body={"status": self._node_status()},
                patch="merge",
            )
        except ApiError as err:
            self._note_refusal(err)
            raise

    async def _untaint_not_ready(self) -> None:
        """Drop the not-ready taint the TaintNodesByCondition admission put on the new Node.

        The node lifecycle controller would, once the node reports Ready; it is disabled in the
        local control plane, and NodeRestriction forbids a node to change its own taints, so the
        simulator does it as admin, standing in for that controller.
        """
        if self.admin is None:
            return
        path = f"/api/v1/nodes/{self.name}"
        for attempt in range(10):
            node = await self.admin.request("GET", path)
            taints = node["spec"].get("taints") or []
            kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
            if len(kept) == len(taints):
                return
            patch = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": kept or None},
            }
            try:
                await self.admin.request("PATCH", path, body=patch, patch="merge")
                return
            except ApiError as err:
                # Another writer (the controller-manager) updated the Node meanwhile.
                if err.status != 409 or attempt == 9:
                    raise
                await asyncio.sleep(0.1)

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_DURATION,
            "renewTime": now_micro(),
        }
        try:
            await self.api.request("PATCH", path, body={"spec": spec}, patch="merge")
            return
        except ApiError as err:
            if err.status != 404:
                self._note_refusal(err)
                raise
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self._node_uid}
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": [owner],
            },
            "spec": spec,
        }
        try:
            await self.api.request("POST", path.rsplit("/", 1)[0], body=body)
        except ApiError as err:
            self._note_refusal(err)
            raise

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(LEASE_RENEW)
            try:
                await self._renew_lease()
            except (ApiError, TimeoutError) as err:
                log.warning("node %s: lease renewal failed: %s", self.name, err)

    # -- pods --------------------------------------------------------------------------------

    async def _pod_loop(self) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.name}"}
        while True:
            try:
                listing = await self.api.request("GET", "/api/v1/pods", params=params)
                version = listing["metadata"]["resourceVersion"]
                seen = set()
                for pod in listing.get("items") or []:
                    seen.add(pod["metadata"]["uid"])
                    self._observe(pod)
                for uid in [u for u in self.pods if u not in seen]:
                    self.pods[uid].vanished()
                self._finished &= seen
                while True:
                    version = await self._watch(params, version)
            except ApiError as err:
                if err.status != 410:
                    self._note_refusal(err)
                    log.warning("node %s: pod watch: %s", self.name, err)
            except (TimeoutError, ValueError) as err:
                log.warning("node %s: pod watch: %r", self.name, err)
            except Exception:
                log.exception("node %s: pod handling failed; relisting", self.name)
            await asyncio.sleep(RELIST_DELAY)

    async def _watch(self, params: Mapping[str, str], version: str) -> str:
        """Follow the pod watch from `version`; the last version seen when it ends."""
        watch_params = {
            **params,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT),
        }
        async for event in self.api.watch("/api/v1/pods", watch_params):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(
                    int(obj.get("code", 500)),
                    str(obj.get("reason", "")),
                    str(obj.get("message", "")),
                )
            version = obj["metadata"]["resourceVersion"]
            if kind in ("ADDED", "MODIFIED"):
                self._observe(obj)
            elif kind == "DELETED":
                uid = obj["metadata"]["uid"]
                self._finished.discard(uid)
                if uid in self.pods:
                    self.pods[uid].vanished()
        return version

    def _observe(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self._finished:
            return
        worker = self.pods.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        worker = PodWorker(self.ctx, pod, self._pod_done)
        self.pods[uid] = worker
        worker.start()

    def _pod_done(self, uid: str) -> None:
        worker = self.pods.pop(uid, None)
        if worker is not None:
            self._finished.add(uid)

    # -- shutdown ----------------------------------------------------------------------------

    async def stop(self, delete_node: bool) -> None:
        """Stop watching and renewing, kill every pod's processes; maybe delete the Node."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        workers = list(self.pods.values())
        await asyncio.gather(
            *(w.terminate(finalize=False, grace=STOP_GRACE) for w in workers),
            return_exceptions=True,
        )
        if delete_node:
            await self._delete_node()
        await self.api.close()

    async def _delete_node(self) -> None:
        """Remove the Lease (as the node) and the Node (as admin: deregistering a node is not
        a kubelet's call, and the Node authorizer refuses a node deleting its own Node)."""
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}"
        for api, path in (
            (self.api, lease),
            (self.admin or self.api, f"/api/v1/nodes/{self.name}"),
        ):
            try:
                await api.request("DELETE", path)
            except ApiError as err:
                if err.status != 404:
                    self._note_refusal(err)
                    raise

    def kill_now(self) -> None:
        for worker in self.pods.values():
            worker.kill_now()
