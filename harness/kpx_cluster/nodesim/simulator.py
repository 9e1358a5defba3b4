"""Node simulator: simulated kubelets that make DaemonSets and Deployments run real processes.

    sim = NodeSimulator(cluster, topology)
    node = sim.add_node("node-1", labels={"role": "edge"}, zone="zone-a")
    ...                      # Pods bound to node-1 now run as processes in node-1's netns
    sim.stop()               # kills every pod process; stop(delete_nodes=True) also removes Nodes

Each simulated node is a netns of the `Topology` plus a kubelet stand-in (nodesim.kubelet)
running on the simulator's own event loop thread with the node's own client certificate. Pods
bound to the node get a netns of their own (or the node's, with hostNetwork), their volumes as
directories, their containers' ``command + args`` as processes, probes, restarts and a status
written through the status subresource. See docs/node-simulator.md for what is and is not
simulated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Collection, Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from ..controlplane import Cluster
from ..netns import Node, Topology
from ..oci import ImageStore
from .api import Credentials, KubeApi, Obj
from .env import base_env
from .kubelet import Kubelet, _arch
from .pod import SimPod
from .relay import ApiRelays
from .runc import HARNESS_IMAGES, RuncRuntime

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["NodeSimulator", "SimPod"]


class NodeSimulator:
    """Simulated nodes for a `Cluster`, built in a `Topology`; see the module docstring."""

    def __init__(
        self,
        cluster: Cluster,
        topology: Topology,
        pod_apiserver_access: bool = False,
        *,
        runtime: Literal["process", "runc"] = "process",
        images: ImageStore | None = None,
        host_images: Collection[str] = HARNESS_IMAGES,
    ) -> None:
        """`runtime="runc"` (with `images`): containers whose image `images` holds run from it
        under runc, those whose image is in `host_images` run as host processes, any other
        image is not pullable (ErrImagePull, ImagePullBackOff). `runtime="process"`: every
        container runs as a host process (its image ignored)."""
        self.cluster = cluster
        self.topology = topology
        self.runc: RuncRuntime | None = None
        if runtime == "runc":
            if images is None:
                raise ValueError('runtime="runc" needs an ImageStore (images=)')
            state = topology.tmpdir / "nodesim" / "runc"
            self.runc = RuncRuntime(images, state, frozenset(host_images))
        elif runtime != "process":
            raise ValueError(f"unknown runtime {runtime!r}")
        self.nodes: dict[str, Node] = {}
        self._kubelets: dict[str, Kubelet] = {}
        self._kubeconfigs: dict[str, Path] = {}
        self._admin: KubeApi | None = None
        self._relays = ApiRelays(topology, cluster.apiserver_port)
        self._relays.enabled = pod_apiserver_access
        self._exposed = False
        self._stopped = False
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="nodesim", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the simulator's loop and wait for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"node simulator: no answer within {timeout}s") from None

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> NodeSimulator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- nodes -------------------------------------------------------------------------------

    @property
    def apiserver_port(self) -> int:
        """The port on every node's loopback where the apiserver answers (through a relay)."""
        return self.cluster.apiserver_port

    @property
    def pod_apiserver_access(self) -> bool:
        """Whether pods with their own netns get a loopback relay to the apiserver.

        Off by default (a relay process per pod). When on, every pod started afterwards that
        mounts a ServiceAccount token reaches the apiserver at KUBERNETES_SERVICE_HOST:PORT
        (127.0.0.1:<apiserver port>), like hostNetwork pods always do.
        """
        return self._relays.enabled

    @pod_apiserver_access.setter
    def pod_apiserver_access(self, enabled: bool) -> None:
        self._relays.enabled = enabled

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        zone: str | None = None,
        taints: Sequence[Obj] = (),
        timeout: float = 30.0,
    ) -> Node:
        """Create node `name` (a topology node) and its kubelet; returns once it is Ready.

        Labels always include kubernetes.io/hostname, kubernetes.io/os, kubernetes.io/arch and,
        with `zone`, topology.kubernetes.io/zone. `taints` are registered with the Node.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError("the node simulator was stopped")
            node = self.topology.add_node(name)
            if not self._exposed:
                self.topology.expose_host_port(self.cluster.apiserver_port)
                self._exposed = True
            node_dir = self.topology.tmpdir / "nodesim" / name
            node_dir.mkdir(parents=True, exist_ok=True)
            kubeconfig = self.cluster.client_kubeconfig(
                f"system:node:{name}", ("system:nodes",), node_dir / "kubelet.kubeconfig"
            )
            all_labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": _arch(),
            }
            if zone:
                all_labels["topology.kubernetes.io/zone"] = zone
            all_labels.update(labels or {})
            if self._admin is None:
                self._admin = KubeApi(
                    Credentials.from_kubeconfig(self.cluster.kubeconfig), "nodesim-admin"
                )
            kubelet = Kubelet(
                self.topology,
                node,
                kubeconfig,
                node_dir,
                base_env(self.cluster.apiserver_port),
                all_labels,
                taints,
                self._admin,
                self._relays,
                self.runc,
            )
            self._kubelets[name] = kubelet
            self._kubeconfigs[name] = kubeconfig
            self.nodes[name] = node
        self._call(kubelet.start(), timeout)
        log.info("node %s registered (netns %s)", name, node.netns)
        return node

    def node_kubeconfig(self, name: str) -> Path:
        """The kubeconfig with node `name`'s own credentials (system:node:<name>)."""
        return self._kubeconfigs[name]

    @property
    def refused(self) -> list[str]:
        """Every request the apiserver refused (403) a simulated kubelet so far."""
        return [r for k in self._kubelets.values() for r in k.ctx.refused]

    @property
    def transient_refusals(self) -> list[str]:
        """Refusals (403) that a retry overcame: the apiserver's caches lagging a binding."""
        return [r for k in self._kubelets.values() for r in k.ctx.transient]

    # -- pods --------------------------------------------------------------------------------

    def pod(self, namespace: str, name: str, timeout: float = 10.0) -> SimPod | None:
        """A snapshot of the running (not terminating) pod `namespace/name`, if simulated here."""

        async def find() -> SimPod | None:
            for kubelet in self._kubelets.values():
                for worker in kubelet.pods.values():
                    if (worker.namespace, worker.name) == (
                        namespace,
                        name,
                    ) and not worker.terminating:
                        return worker.snapshot()
            return None

        if self._stopped:
            return None
        return self._call(find(), timeout)

    def pods(self, timeout: float = 10.0) -> list[SimPod]:
        """Snapshots of every pod the simulated kubelets currently run."""

        async def collect() -> list[SimPod]:
            return [w.snapshot() for k in self._kubelets.values() for w in k.pods.values()]

        return [] if self._stopped else self._call(collect(), timeout)

    def pod_processes(self, namespace: str, name: str) -> list[int]:
        """Pids of the running container processes of pod `namespace/name` (empty if none)."""
        found = self.pod(namespace, name)
        return sorted(found.pids.values()) if found is not None else []

    # -- shutdown ----------------------------------------------------------------------------

    def stop(self, delete_nodes: bool = False, timeout: float = 60.0) -> None:
        """Kill every pod process, stop the kubelets and the loop. Idempotent.

        Node objects stay (a stopped kubelet does not deregister) unless `delete_nodes`.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self._call(self._shutdown(delete_nodes), timeout)
        except Exception:
            log.exception("node simulator shutdown failed; killing pod processes")
            for kubelet in self._kubelets.values():
                kubelet.kill_now()
            raise
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self, delete_nodes: bool) -> None:
        results = await asyncio.gather(
            *(k.stop(delete_node=delete_nodes) for k in self._kubelets.values()),
            return_exceptions=True,
        )
        await self._relays.stop()
        if self._admin is not None:
            await self._admin.close()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
