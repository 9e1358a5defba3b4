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
import hashlib
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
from ..vm import image as vm_image
from ..vm.machine import SCRATCH_MOUNT, Guest, TapLink
from . import cgroups, static_images
from .config import (
    CONTAINERD_START_S,
    HARNESS_POD_HOSTS_FROM,
    KUBELET_SYSCTLS,
    NodePlan,
    cni_conflist,
    containerd_config,
    kubelet_config,
    node_object,
    supervisor_argv,
    supervisor_spec,
)
from .dns import dns_objects

CONTROL_PLANE = "control-plane"
#: Where a node in the proxy-vm guest keeps its data: the guest's scratch disk (not below the
#: paths its data is mounted over: /var/lib, /var/log, /run). Each node imports about 0.85 GB
#: of images for the conformance run; content and snapshots take twice that.
GUEST_DATA = Path(SCRATCH_MOUNT)
GUEST_SCRATCH_GB = 16
GUEST_IMAGE_DISKS = 3
# containerd loads its plugins in seconds on the host and in minutes under the guest's
# emulation when the machine is busy (CI): its socket is waited for this long there.
GUEST_CONTAINERD_START_S = 600


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _guest_run(guest: Guest, argv: list[str]) -> tuple[int, str]:
    """Run argv in `guest`: its exit code and its output (stdout and stderr together)."""
    out: list[bytes] = []
    code = guest.exec(argv, on_output=lambda _c, data: out.append(data))
    return code, b"".join(out).decode(errors="replace")


def _archive_id(archive: Path) -> list[object]:
    stat = archive.stat()
    return [str(archive), stat.st_size, stat.st_mtime_ns]


def guest_mac(index: int) -> str:
    """The MAC of the guest NIC that is node `index`'s fabric link."""
    return f"52:54:00:24:02:{index:02x}"


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
        vm: str | None = None,
        vm_memory_mb: int = 4096,
        late_archives: Sequence[Path] = (),
    ) -> None:
        """`archives`: OCI archives imported on every node besides pause and busybox (and
        CoreDNS with `dns`: cluster DNS, kube-system/coredns behind kube-dns 10.96.0.10).
        `vm`: the nodes run in proxy-vm guest `vm` (booted here with `vm_memory_mb`, one NIC
        per node on the fabric; see vm/guest_node.py) instead of this host's netns: the
        guest's kernel has IPVS. The control plane stays on this host. Its nodes start from a
        cached disk whose image stores hold `archives` (`guest_images`), so only
        `late_archives` (images that change with every build, such as kpx's own) are imported
        at each start; on this host both are imported alike."""
        if not 1 <= nodes <= 200:
            raise ValueError("between 1 and 200 nodes")
        self.name = name
        self.root = root
        self.node_count = nodes
        self.archives = list(archives)
        self.late_archives = list(late_archives)
        self.dns = dns
        self.topology: Topology | None = None
        self.cluster = Cluster(name, root)  # replaced by the netns one in up()
        self.plans: dict[str, NodePlan] = {}
        self._supervisors: dict[str, subprocess.Popen[bytes]] = {}
        self.vm = vm
        self.vm_memory_mb = vm_memory_mb

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
            cached = [*static_images.ensure(log=lambda _: None, wanted=wanted), *self.archives]
            archives = [*cached, *self.late_archives]
            if self.vm:
                self._boot_guest(self.guest_images(cached))
            # All nodes start at once (each imports its images), then each is waited for.
            for name in self.node_names:
                self._start_node(name, archives)
            # Under the guest's emulation each image import and the kubelet's start take
            # several times as long.
            slower = 4 if self.vm else 1
            for name in self.node_names:
                self._wait_supervisor(name, 180 * slower)
            self.wait_ready(timeout * slower)
            if self.dns:
                self._start_dns(timeout)
        except BaseException:
            self.down()
            raise

    def _save_state(self) -> None:
        state = {"prefix": self.prefix, "nodes": self.node_names, "pid": os.getpid()}
        (self.cluster.state_dir / "real-nodes.json").write_text(json.dumps(state))

    # -- nodes in the proxy-vm guest ----------------------------------------------------------
    def _store_plan(self, name: str) -> NodePlan:
        """Node `name`'s paths for making the image disk (no network, no cgroup)."""
        return NodePlan(
            name=name,
            netns="",
            ipv4="",
            ipv6="",
            pod_cidr_v4="",
            pod_cidr_v6="",
            gateway_v4="",
            gateway_v6="",
            cgroup="",
            dir=self.cluster.state_dir / "image-store" / name,
            data_dir=GUEST_DATA / name,
        )

    def guest_images(self, archives: Sequence[Path]) -> Path:
        """A disk image (ext4, GUEST_SCRATCH_GB sparse) holding, in each node's data directory,
        a containerd store with `archives` imported: the nodes' scratch disk starts from it, so
        their supervisors skip those images (importing 0.85 GB under the guest's emulation
        takes 12 min and more per node). Cached in the cache directory by the archives, the
        node names and the guest image's recipe; made on a miss: one guest imports into the
        first node's store and copies it to the others'. The GUEST_IMAGE_DISKS most recently
        used are kept (the e2e test's and the conformance run's differ)."""
        assert self.vm
        key = json.dumps(
            {
                "archives": [_archive_id(a) for a in archives],
                "nodes": self.node_names,
                "guest": vm_image.recipe_hash(),
                "layout": 1,  # the store plan's data paths and the steps below
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        disk = vm_image.vm_cache() / f"images-{digest}.img"
        if disk.exists():
            disk.touch()  # recently used: kept when older ones go
            return disk
        builder = Guest(f"{self.vm}-images")
        try:
            builder.up(_log, memory_mb=self.vm_memory_mb, scratch_gb=GUEST_SCRATCH_GB)
            first = self._store_plan(self.node_names[0])
            for d in (first.etc, first.cni_conf_dir, first.log_dir):
                d.mkdir(parents=True, exist_ok=True)
            first.containerd_config.write_text(containerd_config(first))
            spec = supervisor_spec(
                first,
                kubernetes_binary("kubelet"),
                _containerd_binary(),
                [],
                GUEST_CONTAINERD_START_S,
            )
            spec["archives"] = [str(a) for a in archives]
            spec["importOnly"] = True
            spec["mounts"] = [m for m in spec["mounts"] if not m["target"].startswith("/proc")]
            first.spec_file.write_text(json.dumps(spec, indent=2))
            steps = [
                {
                    "importOnly": True,
                    "dirs": [str(first.var_lib), str(first.var_log)],
                    "supervisorSpec": str(first.spec_file),
                }
            ]
            store = first.var_lib / "containerd"
            steps += [
                {"copyStore": [str(store), str(self._store_plan(n).var_lib / "containerd")]}
                for n in self.node_names[1:]
            ]
            for i, step in enumerate(steps):
                step_file = self.cluster.state_dir / "image-store" / f"step-{i}.json"
                step_file.write_text(json.dumps(step))
                code, out = _guest_run(
                    builder, ["python3", "-m", "kpx_cluster.vm.guest_node", str(step_file)]
                )
                if code != 0 or "imported" not in out:
                    raise NodeStartFailed(f"making the guest image disk: {out}")
            code, out = _guest_run(builder, ["umount", SCRATCH_MOUNT])
            if code != 0:
                raise NodeStartFailed(f"making the guest image disk: umount: {out}")
            kept = sorted(vm_image.vm_cache().glob("images-*.img"), key=lambda p: p.stat().st_mtime)
            for old in kept[: max(0, len(kept) - (GUEST_IMAGE_DISKS - 1))]:
                old.unlink(missing_ok=True)
            builder.scratch.rename(disk)
        finally:
            builder.down()
        return disk

    def _boot_guest(self, images_disk: Path) -> None:
        """The nodes' links (a tap each on the fabric), then the guest with one NIC per tap."""
        assert self.topology is not None and self.vm
        links: list[TapLink] = []
        try:
            for name in self.node_names:
                node, tap = self.topology.add_remote_node(name)
                fd = netns_toolkit.open_tap(self.topology.fabric_netns, tap)
                links.append(TapLink(fd=fd, mac=guest_mac(node.index)))
            Guest(self.vm).up(
                _log, memory_mb=self.vm_memory_mb, taps=tuple(links), scratch_from=images_disk
            )
        finally:
            for link in links:
                os.close(link.fd)

    def _plan(self, name: str) -> NodePlan:
        assert self.topology is not None
        if self.vm:
            node = self.topology.nodes[name]
        else:
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
            data_dir=GUEST_DATA / name if self.vm else None,
        )

    @staticmethod
    def _data_files(plan: NodePlan) -> tuple[list[Path], dict[Path, str]]:
        """The node's data directories and the kubelet's sysctl files (see config.node_mounts)."""
        dirs = [plan.var_lib, plan.var_log, plan.sysctl_dir]
        files = {
            plan.sysctl_dir / key.replace("/", "."): value + "\n"
            for key, value in KUBELET_SYSCTLS.items()
        }
        return dirs, files

    def _write_files(self, plan: NodePlan, archives: list[Path]) -> None:
        for d in (plan.etc, plan.cni_conf_dir, plan.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        if plan.data_dir is None:  # a guest node's are made in the guest
            dirs, files = self._data_files(plan)
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
            for path, text in files.items():
                path.write_text(text)
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
        spec = supervisor_spec(
            plan,
            kubernetes_binary("kubelet"),
            _containerd_binary(),
            archives,
            GUEST_CONTAINERD_START_S if self.vm else CONTAINERD_START_S,
        )
        plan.spec_file.write_text(json.dumps(spec, indent=2))

    def _start_node(self, name: str, archives: list[Path]) -> None:
        assert self.topology is not None
        plan = self._plan(name)
        self.plans[name] = plan
        self._write_files(plan, archives)
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(node_object(plan)))
        if self.vm:
            self._start_guest_node(plan)
            return
        cgroups.create(plan.runtime_cgroup)
        argv = supervisor_argv(plan.netns, plan.spec_file, sys.executable)
        with (plan.log_dir / "supervisor.log").open("ab") as log:
            self._supervisors[name] = self.topology.run_host(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_join_cgroup_fn(plan.runtime_cgroup),
            )

    def _start_guest_node(self, plan: NodePlan) -> None:
        """Run vm/guest_node.py for `plan` in the guest through `proxy-vm exec` (a host process
        whose output is the guest program's: the supervisor's `ready`)."""
        assert self.topology is not None and self.vm
        node = self.topology.nodes[plan.name]
        dirs, files = self._data_files(plan)
        spec = {
            "netns": plan.netns,
            "mac": guest_mac(node.index),
            "fabricIf": node.fabric_if,
            "sysctls": list(netns_toolkit.NODE_SYSCTLS),
            "linkCommands": netns_toolkit.node_link_commands(node, self.topology.service_cidrs),
            "routes": self.topology.pod_routes(node),
            "dirs": [str(d) for d in dirs],
            "files": {str(path): text for path, text in files.items()},
            "runtimeCgroup": plan.runtime_cgroup,
            "supervisorSpec": str(plan.spec_file),
        }
        guest_spec = plan.dir / "guest-node.json"
        guest_spec.write_text(json.dumps(spec, indent=2))
        argv = [
            sys.executable,
            "-m",
            "kpx_cluster.vm.cli",
            "exec",
            f"--name={self.vm}",
            "--",
            "python3",
            "-m",
            "kpx_cluster.vm.guest_node",
            str(guest_spec),
        ]
        with (plan.log_dir / "supervisor.log").open("ab") as log:
            self._supervisors[plan.name] = self.topology.run_host(
                argv, stdout=subprocess.PIPE, stderr=log
            )

    def _wait_supervisor(self, name: str, timeout: float = 180) -> None:
        """Until node `name`'s supervisor says `ready` (containerd up, images imported, the
        kubelet started)."""
        try:
            netns_toolkit.wait_for_line(self._supervisors[name], "ready", timeout)
        except netns_toolkit.TopologyError as exc:
            log_dir = self.plans[name].log_dir
            said = []  # the last words of each log (down removes the directory)
            for log in ("supervisor", "containerd", "kubelet"):
                with contextlib.suppress(OSError):
                    tail = (log_dir / f"{log}.log").read_text().strip().splitlines()[-5:]
                    if tail:
                        said.append(f"{log}.log ends: " + " | ".join(tail))
            raise NodeStartFailed(f"node {name}: {exc}; see {log_dir}; " + "; ".join(said)) from exc

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
        if self.vm:
            # Everything the nodes ran is in the guest; its taps go with the fabric netns.
            Guest(self.vm).down()
        elif self.topology is not None:
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
