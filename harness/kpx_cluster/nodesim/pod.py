"""One pod on a simulated node: sandbox (netns), volumes, containers, status, termination."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..netns import Node, Pod, Target, Topology
from .api import ApiError, KubeApi, Obj, now_rfc3339
from .container import Container, ContainerContext
from .env import EnvBuilder, PathMap
from .probe import cancel_all
from .process import Process
from .relay import ApiRelays
from .runc import RuncRuntime
from .runc import mounts as runc_mounts
from .status import (
    CONTAINER_CREATING,
    POD_INITIALIZING,
    ContainerFacts,
    condition,
    container_status,
    pod_conditions,
    pod_phase,
    transition_time,
)
from .volumes import SA_MOUNT, ObjectCache, PodVolumes, TokenCache, VolumeError

log = logging.getLogger(__name__)

MAX_GRACE = 5.0
VOLUME_RESYNC = 2.0
STATUS_DEBOUNCE = 0.05
_sandbox_ids = itertools.count(1)


@dataclass
class NodeContext:
    """What all pods of one simulated node share."""

    topology: Topology
    node: Node
    api: KubeApi
    objects: ObjectCache
    tokens: TokenCache
    node_dir: Path
    base_env: dict[str, str]
    relays: ApiRelays | None = None
    runc: RuncRuntime | None = None
    """Containers run from their images under runc (None: every container a host process)."""
    refused: list[str] = field(default_factory=list)
    """Every request the apiserver refused (403) this node, for reports."""

    transient: list[str] = field(default_factory=list)
    """Refusals that a retry of the same request overcame (apiserver cache lag), for reports."""

    def note_refusal(self, err: BaseException, transient: bool = False) -> None:
        """Record `err` (or the ApiError it was raised from) if it is a 403."""
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ApiError):
            cause = cause.__cause__
        if isinstance(cause, ApiError) and cause.status == 403:
            (self.transient if transient else self.refused).append(str(cause))
            if not transient:
                log.warning("node %s: refused: %s", self.node.name, cause)


@dataclass(frozen=True)
class SimPod:
    """A snapshot of one simulated pod, for tests and tools."""

    namespace: str
    name: str
    uid: str
    node: str
    netns: str
    ips: tuple[str, ...]
    directory: Path
    volumes: dict[str, Path]
    logs: dict[str, Path]
    pids: dict[str, int]


def grace_seconds(pod: Obj) -> float:
    """The termination grace period of `pod`, capped at MAX_GRACE."""
    meta, spec = pod["metadata"], pod["spec"]
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = spec.get("terminationGracePeriodSeconds", 30)
    return min(float(grace), MAX_GRACE)


def _sandbox_name(pod_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]", "-", pod_name.lower())[:24].strip("-") or "pod"
    return f"{stem}-{next(_sandbox_ids)}"


class PodWorker:
    """Runs one pod (by uid) as its node's kubelet would, until terminated."""

    def __init__(self, node: NodeContext, pod: Obj, on_done: Callable[[str], None]) -> None:
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.on_done = on_done
        self.directory = node.node_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.volumes = PodVolumes(pod, self.directory, node.node_dir, node.objects, node.tokens)
        self.sandbox: Pod | None = None
        self.target: Target = node.node
        self.ips: tuple[str, ...] = ()
        self.start_time = ""
        self.setup_message = ""
        self.initialized = False
        self.init_failed = False
        self.init_containers: list[tuple[Container, asyncio.Task[Any]]] = []
        self.containers: list[tuple[Container, asyncio.Task[Any]]] = []
        self.terminating = False
        self._finished = asyncio.Event()
        self._dirty = asyncio.Event()
        self._last_status = ""
        self._cond_times: dict[str, tuple[str, str]] = {}
        self._sandbox_future: asyncio.Future[Pod] | None = None
        self._relay: Process | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._main: asyncio.Task[None] | None = None

    @property
    def spec(self) -> Obj:
        return dict(self.pod["spec"])

    @property
    def host_network(self) -> bool:
        return bool(self.spec.get("hostNetwork"))

    @property
    def deletion_requested(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    # -- driven by the kubelet ---------------------------------------------------------------

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name=f"pod-{self.namespace}/{self.name}")
        self._main.add_done_callback(self._main_done)

    def _main_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("pod %s/%s failed", self.namespace, self.name, exc_info=task.exception())

    def update(self, pod: Obj) -> None:
        """A newer version of the pod object (watch)."""
        self.pod = pod
        self.volumes.pod = pod
        self.changed()  # readiness gates or labels may have changed
        if self.deletion_requested and not self.terminating:
            self._spawn(self.terminate(finalize=True))

    def vanished(self) -> None:
        """The pod no longer exists in the apiserver (deleted, or force-deleted)."""
        if not self.terminating:
            self._spawn(self.terminate(finalize=False))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tasks.append(task)

    def changed(self) -> None:
        """Something visible in the status may have changed: push it (debounced)."""
        self._dirty.set()

    # -- running -----------------------------------------------------------------------------

    async def _run(self) -> None:
        if (self.pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return  # finished before we saw it: nothing to run, only deletion to finalize
        if self.deletion_requested:
            await self.terminate(finalize=True)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "logs").mkdir(exist_ok=True)
        self.start_time = now_rfc3339()
        self._tasks.append(asyncio.create_task(self._status_loop()))
        await self._setup_sandbox()
        self.changed()
        await self._setup_volumes()
        self._tasks.append(asyncio.create_task(self._volume_loop()))
        policy = str(self.spec.get("restartPolicy", "Always"))
        for spec in self.spec.get("initContainers") or []:
            container = Container(self._context(spec), spec, init=True)
            if spec.get("restartPolicy") == "Always":  # a sidecar: runs alongside, restarted
                self.init_containers.append(
                    (container, asyncio.create_task(container.run("Always")))
                )
                continue
            task = asyncio.create_task(container.run("Never" if policy == "Never" else "OnFailure"))
            self.init_containers.append((container, task))
            info = await task
            if info is None or info.exit_code != 0:
                self.init_failed = True
                self.changed()
                return
            container.ready = True
            self.changed()
        self.initialized = True
        if self.terminating:
            return
        for spec in self.spec["containers"]:
            container = Container(self._context(spec), spec)
            self.containers.append((container, asyncio.create_task(container.run(policy))))
        self.changed()
        await asyncio.gather(*(task for _, task in self.containers), return_exceptions=True)
        self.changed()

    async def _setup_sandbox(self) -> None:
        node = self.node.node
        if self.host_network:
            self.ips = (node.ipv4, node.ipv6)
            return
        name = _sandbox_name(self.name)
        self._sandbox_future = asyncio.ensure_future(
            asyncio.to_thread(self.node.topology.add_pod, node, name)
        )
        self.sandbox = await asyncio.shield(self._sandbox_future)
        self.target = self.sandbox
        self.ips = (self.sandbox.ipv4, self.sandbox.ipv6)
        relays = self.node.relays
        if relays is not None and self._mounts_service_account():
            try:
                self._relay = await relays.start_in(self.sandbox)
            except Exception:
                log.exception("pod %s/%s: no apiserver relay", self.namespace, self.name)

    def _mounts_service_account(self) -> bool:
        containers = [*(self.spec.get("initContainers") or []), *self.spec["containers"]]
        mounts = (m for c in containers for m in c.get("volumeMounts") or [])
        return any(m["mountPath"].rstrip("/") == SA_MOUNT for m in mounts)

    async def _setup_volumes(self) -> None:
        # Right after binding, the apiserver's caches (the Node authorizer's graph, the
        # NodeRestriction pod lister) may not know the pod is ours yet and refuse its
        # TokenRequest or ConfigMap reads: retry soon, and report such refusals as transient.
        delays = iter((0.2, 0.4, 0.8, 1.6))
        refusals: list[VolumeError] = []
        try:
            while True:
                try:
                    await self.volumes.sync()
                    self.setup_message = ""
                    for overcome in refusals:
                        self.node.note_refusal(overcome, transient=True)
                    refusals.clear()
                    return
                except VolumeError as err:
                    refusals.append(err)
                    if self.setup_message != str(err):
                        log.info("pod %s/%s: %s", self.namespace, self.name, err)
                        self.setup_message = str(err)
                        self.changed()
                await asyncio.sleep(next(delays, VOLUME_RESYNC))
        finally:
            for failure in refusals:  # never overcome
                self.node.note_refusal(failure)

    async def _volume_loop(self) -> None:
        while True:
            await asyncio.sleep(VOLUME_RESYNC)
            try:
                if await self.volumes.sync():
                    log.info("pod %s/%s: volumes updated", self.namespace, self.name)
            except VolumeError as err:
                self.node.note_refusal(err)
                log.warning("pod %s/%s: volume resync: %s", self.namespace, self.name, err)

    def _context(self, spec: Obj) -> ContainerContext:
        mounts = []
        for mount in spec.get("volumeMounts") or []:
            real = self.volumes.dirs.get(mount["name"])
            if real is not None:
                mounts.append((str(mount["mountPath"]), real / mount.get("subPath", "")))
        node = self.node.node
        return ContainerContext(
            topology=self.node.topology,
            target=self.target,
            netns=self.sandbox.netns if self.sandbox is not None else node.netns,
            probe_host=self.ips[0],
            log_dir=self.directory / "logs",
            cwd=self.directory,
            env=EnvBuilder(self._env_pod(), self.node.objects, PathMap(mounts)),
            base_env=self.node.base_env,
            grace=grace_seconds(self.pod),
            changed=self.changed,
            note_refusal=self.node.note_refusal,
            runc=self.node.runc,
            runc_env=EnvBuilder(self._env_pod(), self.node.objects, PathMap(())),
            runc_base_env={
                k: v for k, v in self.node.base_env.items() if k.startswith("KUBERNETES_")
            },
            volume_mounts=tuple(runc_mounts(self.spec, spec, self.volumes.dirs)),
            pod_security=self.spec.get("securityContext") or {},
            pod_name=self.name,
            pod_uid=self.uid,
            hostname=node.name if self.host_network else self.name,
        )

    def _env_pod(self) -> Obj:
        """The pod as the downward API sees it when a container starts: with our own IPs (the
        watched object may not carry the status we are about to report yet)."""
        node = self.node.node
        status = dict(self.pod.get("status") or {})
        status.update(
            podIP=self.ips[0],
            podIPs=[{"ip": ip} for ip in self.ips],
            hostIP=node.ipv4,
            hostIPs=[{"ip": node.ipv4}, {"ip": node.ipv6}],
        )
        return {**self.pod, "status": status}

    # -- termination -------------------------------------------------------------------------

    async def terminate(self, finalize: bool, grace: float | None = None) -> None:
        """Stop every container (SIGTERM, grace, SIGKILL), remove the sandbox and volumes.

        With `finalize` (the pod has a deletionTimestamp), report the terminal status and delete
        the pod object like a kubelet does: gracePeriodSeconds=0 with a uid precondition.
        """
        if self.terminating:
            await self._finished.wait()
            return
        self.terminating = True
        grace = grace_seconds(self.pod) if grace is None else grace
        try:
            running = [*self.init_containers, *self.containers]
            await asyncio.gather(*(c.stop(task, grace) for c, task in running))
            current = asyncio.current_task()
            main = self._main
            if main is not None and main is not current and not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await main
            await cancel_all([t for t in self._tasks if t is not current])
            if finalize and self.start_time:
                await self._push_status(final=True)
            await self._remove_sandbox()
            self.volumes.remove()
            if finalize:
                await self._delete()
        finally:
            self._finished.set()
            self.on_done(self.uid)

    async def _remove_sandbox(self) -> None:
        if self._sandbox_future is not None and self.sandbox is None:
            with contextlib.suppress(Exception):
                self.sandbox = await self._sandbox_future
        if self.sandbox is None:
            return
        if self._relay is not None:
            await self._relay.stop(0.5)
            self._relay = None
        sandbox, self.sandbox = self.sandbox, None
        await asyncio.to_thread(
            subprocess.run, ["ip", "netns", "del", sandbox.netns], capture_output=True, check=False
        )
        self.node.topology.pods.pop(sandbox.name, None)

    async def _delete(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        body: Obj = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            await self.node.api.request("DELETE", path, body=body)
        except ApiError as err:
            self.node.note_refusal(err)
            if err.status not in (404, 409):
                log.warning(
                    "pod %s/%s: finalizing the deletion: %s", self.namespace, self.name, err
                )

    def kill_now(self) -> None:
        """SIGKILL every container process (shutdown paths)."""
        for container, _ in [*self.init_containers, *self.containers]:
            container.kill_now()

    # -- status ------------------------------------------------------------------------------

    async def _status_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.sleep(STATUS_DEBOUNCE)
            if not await self._push_status():
                await asyncio.sleep(1)
                self._dirty.set()

    async def _push_status(self, final: bool = False) -> bool:
        """Patch the pod's status if it changed; False if that should be retried."""
        status = self.status(final)
        key = json.dumps(status, sort_keys=True)
        if key == self._last_status:
            return True
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status"
        patch = {"metadata": {"uid": self.uid}, "status": status}
        try:
            await self.node.api.request("PATCH", path, body=patch, patch="strategic")
        except ApiError as err:
            self.node.note_refusal(err)
            if err.status in (404, 409):  # gone, or replaced by a pod with another uid
                self._last_status = key
                return True
            log.warning("pod %s/%s: status update: %s", self.namespace, self.name, err)
            if err.status == 422:  # invalid: retrying the same status would not help
                self._last_status = key
                return True
            return False
        self._last_status = key
        return True

    def _condition(self, kind: str, ok: bool, reason: str) -> Obj:
        self._cond_times[kind] = transition_time(self._cond_times.get(kind), ok, now_rfc3339())
        return condition(kind, ok, reason, self._cond_times[kind][1])

    def _gates_ok(self) -> bool:
        gates = [g["conditionType"] for g in self.spec.get("readinessGates") or []]
        conds = {
            c["type"]: c["status"] for c in (self.pod.get("status") or {}).get("conditions") or []
        }
        return all(conds.get(g) == "True" for g in gates)

    def _placeholder(self, spec: Obj, reason: str) -> Obj:
        facts = ContainerFacts(
            str(spec["name"]), str(spec.get("image", "")), waiting=(reason, self.setup_message)
        )
        return container_status(facts)

    def status(self, final: bool = False) -> Obj:
        """The kubelet-owned part of the pod's status, as it is now."""
        running = {c.name: c for c, _ in self.containers}
        inits = {c.name: c for c, _ in self.init_containers}
        waiting_reason = POD_INITIALIZING if self.spec.get("initContainers") else CONTAINER_CREATING
        statuses = [
            running[s["name"]].status()
            if s["name"] in running
            else self._placeholder(s, waiting_reason)
            for s in self.spec["containers"]
        ]
        init_statuses = [
            inits[s["name"]].status()
            if s["name"] in inits
            else self._placeholder(s, POD_INITIALIZING)
            for s in self.spec.get("initContainers") or []
        ]
        started = [st for st in statuses if st["name"] in running]
        phase = pod_phase(started, self.init_failed, final)
        conditions = pod_conditions(
            sandbox_ready=bool(self.ips),
            initialized=self.initialized,
            containers_ready=bool(running) and all(c.ready for c in running.values()),
            gates_ok=self._gates_ok(),
            terminal=phase in ("Succeeded", "Failed"),
        )
        status: Obj = {
            "phase": phase,
            "conditions": [self._condition(*c) for c in conditions],
            "containerStatuses": statuses,
        }
        if self.start_time:
            status["startTime"] = self.start_time
        node = self.node.node
        status["hostIP"] = node.ipv4
        status["hostIPs"] = [{"ip": node.ipv4}, {"ip": node.ipv6}]
        if self.ips:
            status["podIP"] = self.ips[0]
            status["podIPs"] = [{"ip": ip} for ip in self.ips]
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        return status

    def snapshot(self) -> SimPod:
        containers = [*self.init_containers, *self.containers]
        return SimPod(
            namespace=self.namespace,
            name=self.name,
            uid=self.uid,
            node=self.node.node.name,
            netns=self.sandbox.netns if self.sandbox is not None else self.node.node.netns,
            ips=self.ips,
            directory=self.directory,
            volumes=dict(self.volumes.dirs),
            logs={c.name: c.log_file for c, _ in containers},
            pids={c.name: c.pid for c, _ in containers if c.pid is not None},
        )
