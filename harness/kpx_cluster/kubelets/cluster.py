"""A local cluster of real nodes: the control plane in a network namespace of its own and N
real kubelets, each with its own containerd, in a node netns and a mount namespace of its own.

    with RealCluster("e2e", nodes=2) as rc:   # up() on enter, down() on exit
        rc.cluster.kubectl("get", "nodes")

Layout (docs/real-kubelets.md): a `Topology` gives the fabric (one bridge) and, on it, the
control plane's netns (10.242.0.1, routes to every pod CIDR) and one netns per node
(10.242.0.<i>, a bridge cbr0 with the node's pod CIDRs, routes to the other nodes' pod CIDRs).
No netns has a default route: a packet for anywhere else is unroutable, so none leaves the
machine, and nothing here touches the host netns's routes or firewall.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from .. import netns as netns_toolkit
from ..binaries import kubernetes_binary
from ..controlplane import DEFAULT_ROOT, AlreadyRunning, Cluster
from ..netns import Topology
from . import cgroups, static_images
from .config import (
    HARNESS_POD_HOSTS_FROM,
    KUBELET_SYSCTLS,
    NodePlan,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_object,
    supervisor_spec,
)
from .dns import dns_objects

CONTROL_PLANE = "control-plane"


class NodeStartFailed(RuntimeError):
    """A node's supervisor did not get its containerd and kubelet running."""


def _containerd_binary() -> Path:
    for candidate in ("/usr/bin/containerd", "/usr/local/bin/containerd"):
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    raise NodeStartFailed("containerd is not installed: run `make setup`")


def _join_cgroup_fn(path: str) -> Any:
    """A preexec_fn moving the child into `path` in every hierarchy (plain os calls only)."""
    targets = [str(root / path / "cgroup.procs") for root in cgroups.hierarchies()]

    def join() -> None:
        for target in targets:
            fd = os.open(target, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    return join


class RealCluster:
    """The control plane and `nodes` real nodes; see the module docstring."""

    def __init__(
        self,
        name: str = "kpx",
        nodes: int = 2,
        root: Path = DEFAULT_ROOT,
        archives: Sequence[Path] = (),
        dns: bool = True,
    ) -> None:
        """`archives`: OCI archives imported on every node besides pause and busybox (and
        CoreDNS with `dns`: cluster DNS, kube-system/coredns behind kube-dns 10.96.0.10)."""
        if not 1 <= nodes <= 200:
            raise ValueError("between 1 and 200 nodes")
        self.name = name
        self.root = root
        self.node_count = nodes
        self.archives = list(archives)
        self.dns = dns
        self.topology: Topology | None = None
        self.cluster = Cluster(name, root)  # replaced by the netns one in up()
        self.plans: dict[str, NodePlan] = {}
        self._supervisors: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> RealCluster:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    @property
    def prefix(self) -> str:
        assert self.topology is not None
        return self.topology.prefix

    @property
    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(1, self.node_count + 1)]

    # -- up ------------------------------------------------------------------------------------
    def up(self, timeout: float = 180.0) -> None:
        """Control plane, nodes, then wait until every Node is Ready."""
        if Cluster(self.name, self.root).is_running():  # not ours: a failed up must not stop it
            raise AlreadyRunning(
                f"cluster {self.name!r} already runs; `proxy-cluster down` stops it"
            )
        self.topology = Topology()
        # Also when the process ends without `down` (exit, SIGTERM, SIGINT): the topology's
        # cleanup stops the nodes and the control plane first.
        self.topology.on_cleanup(self._stop_nodes_and_control_plane)
        try:
            cp = self.topology.add_node(CONTROL_PLANE)
            self.cluster = Cluster(self.name, self.root, netns=cp.netns, advertise=cp.ipv4)
            self.cluster.up()
            self._save_state()
            wanted = (*static_images.STATIC_IMAGES, *((static_images.COREDNS,) if self.dns else ()))
            archives = [*static_images.ensure(log=lambda _: None, wanted=wanted), *self.archives]
            # All nodes start at once (each imports its images), then each is waited for.
            for name in self.node_names:
                self._start_node(name, archives)
            for name in self.node_names:
                self._wait_supervisor(name)
            self.wait_ready(timeout)
            if self.dns:
                self._start_dns(timeout)
        except BaseException:
            self.down()
            raise

    def _save_state(self) -> None:
        state = {"prefix": self.prefix, "nodes": self.node_names, "pid": os.getpid()}
        (self.cluster.state_dir / "real-nodes.json").write_text(json.dumps(state))

    def _plan(self, name: str) -> NodePlan:
        assert self.topology is not None
        node = self.topology.add_node(name, pod_hosts_from=HARNESS_POD_HOSTS_FROM)
        return NodePlan(
            name=name,
            netns=node.netns,
            ipv4=node.ipv4,
            ipv6=node.ipv6,
            pod_cidr_v4=node.pod_cidr_v4,
            pod_cidr_v6=node.pod_cidr_v6,
            gateway_v4=node.gateway_v4,
            gateway_v6=node.gateway_v6,
            cgroup=f"{self.prefix}-{name}",
            dir=self.cluster.state_dir / "nodes" / name,
        )

    def _write_files(self, plan: NodePlan, archives: list[Path]) -> None:
        for d in (
            plan.var_lib,
            plan.var_log,
            plan.etc,
            plan.cni_conf_dir,
            plan.sysctl_dir,
            plan.log_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        for key, value in KUBELET_SYSCTLS.items():
            (plan.sysctl_dir / key.replace("/", ".")).write_text(value + "\n")
        plan.resolv_conf.write_text("# no upstream resolvers: nothing leaves the machine\n")
        plan.containerd_config.write_text(containerd_config(plan))
        plan.kubelet_config.write_text(
            yaml.safe_dump(kubelet_config(plan, self.cluster.ca_file), sort_keys=False)
        )
        (plan.cni_conf_dir / "10-kpx.conflist").write_text(json.dumps(cni_conflist(plan), indent=2))
        self.cluster.client_kubeconfig(
            f"system:node:{plan.name}",
            ("system:nodes",),
            plan.kubeconfig,
            server=self.cluster.cluster_server,
        )
        spec = supervisor_spec(plan, kubernetes_binary("kubelet"), _containerd_binary(), archives)
        plan.spec_file.write_text(json.dumps(spec, indent=2))

    def _start_node(self, name: str, archives: list[Path]) -> None:
        assert self.topology is not None
        plan = self._plan(name)
        self.plans[name] = plan
        self._write_files(plan, archives)
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(node_object(plan)))
        cgroups.create(plan.runtime_cgroup)
        argv = [
            "nsenter",
            f"--net=/run/netns/{plan.netns}",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "--",
            sys.executable,
            "-m",
            "kpx_cluster.kubelets.supervisor",
            str(plan.spec_file),
        ]
        with (plan.log_dir / "supervisor.log").open("ab") as log:
            self._supervisors[name] = self.topology.run_host(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_join_cgroup_fn(plan.runtime_cgroup),
            )

    def _wait_supervisor(self, name: str, timeout: float = 180) -> None:
        """Until node `name`'s supervisor says `ready` (containerd up, images imported, the
        kubelet started)."""
        try:
            netns_toolkit.wait_for_line(self._supervisors[name], "ready", timeout)
        except netns_toolkit.TopologyError as exc:
            raise NodeStartFailed(f"node {name}: {exc}; see {self.plans[name].log_dir}") from exc

    def _start_dns(self, timeout: float) -> None:
        host, port = self.cluster.cluster_server.removeprefix("https://").rsplit(":", 1)
        objects = {"apiVersion": "v1", "kind": "List", "items": dns_objects(host, port)}
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(objects))
        self.cluster.kubectl(
            "-n",
            "kube-system",
            "rollout",
            "status",
            "deploy/coredns",
            f"--timeout={timeout:.0f}s",
            timeout=timeout + 10,
        )

    def nodes(self) -> dict[str, dict[str, Any]]:
        got = self.cluster.kubectl("get", "nodes", "-o", "json")
        return {n["metadata"]["name"]: n for n in json.loads(got.stdout)["items"]}

    @staticmethod
    def is_ready(node: dict[str, Any]) -> bool:
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._supervisors.items():
                if proc.poll() is not None:
                    raise NodeStartFailed(
                        f"node {name}'s supervisor exited; see {self.plans[name].log_dir}"
                    )
            nodes = self.nodes()
            if all(self.is_ready(nodes.get(n, {})) for n in self.node_names):
                return
            if time.monotonic() > deadline:
                waiting = [n for n in self.node_names if not self.is_ready(nodes.get(n, {}))]
                raise NodeStartFailed(f"nodes not Ready after {timeout:.0f}s: {waiting}")
            time.sleep(0.5)

    # -- down ----------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Stop every node (kubelet, containerd, pods: all in the node's cgroups), the control
        plane, and remove every netns, cgroup and file; returns what was still left (empty
        when clean). Idempotent."""
        left = self._stop_nodes_and_control_plane()
        if self.topology is not None:
            prefix = self.topology.prefix
            self.topology.cleanup()
            left += cgroups.leftovers(prefix) + netns_toolkit.leftovers(prefix)
        return left

    def _stop_nodes_and_control_plane(self) -> list[str]:
        for proc in self._supervisors.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self._supervisors.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
        self._supervisors.clear()
        left: list[str] = []
        if self.topology is not None:
            for plan in self.plans.values():
                left += cgroups.remove(plan.cgroup)
        self.cluster.down()
        return left


def sweep(prefix: str) -> list[str]:
    """Remove what a RealCluster with topology `prefix` left (its process died unclean): every
    process in its nodes' cgroups and the cgroups, then the topology's processes, namespaces
    and paths. Returns what is still left (empty when clean)."""
    for top in cgroups.leftovers(prefix):
        cgroups.remove(Path(top).name)
    return cgroups.leftovers(prefix) + netns_toolkit.remove_leftovers(prefix)
