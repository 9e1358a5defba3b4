"""Real nodes in the proxy-vm guest (`RealCluster(vm=...)`): the plain pieces both sides share
(a node's link commands, the guest NIC's MAC, the data directory's paths), the cgroup v2
delegation the guest's unified hierarchy needs, and finding a NIC by MAC. The whole path (a
guest node Ready, a pod on it, exec) runs in tests/e2e/test_guest_nodes.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_real_node_config import PLAN

from kpx_cluster import netns
from kpx_cluster.conformance.run import Target
from kpx_cluster.kubelets import cgroups, config
from kpx_cluster.kubelets.cluster import GUEST_DATA, guest_mac
from kpx_cluster.vm import guest_node

NODE = netns.Node(
    name="node-1",
    index=2,
    netns="kpx0a0b0c-n-node-1",
    ipv4="10.242.0.2",
    ipv6="fd00:242::2",
    pod_cidr_v4="10.244.2.0/24",
    pod_cidr_v6="fd00:244:2::/64",
    gateway_v4="10.244.2.1",
    gateway_v6="fd00:244:2::1",
    fabric_if="kpx0a0b0cf2",
)


def test_a_nodes_link_commands_address_the_link_and_make_cbr0_with_the_gateways() -> None:
    commands = netns.node_link_commands(NODE, ["10.96.0.0/16", "fd00:96::/112"])
    assert ["addr", "add", "10.242.0.2/24", "dev", "kpx0a0b0cf2"] in commands
    assert ["addr", "add", "fd00:242::2/64", "dev", "kpx0a0b0cf2", "nodad"] in commands
    cbr0 = next(c for c in commands if c[:3] == ["link", "add", "cbr0"])
    assert cbr0[3:5] == ["address", NODE.gateway_mac]
    assert ["addr", "add", "10.244.2.1/24", "dev", "cbr0"] in commands
    assert ["addr", "add", "fd00:244:2::1/64", "dev", "cbr0", "nodad"] in commands
    # the Service CIDRs go to the fabric (a proxy answers them before they leave)
    assert ["route", "replace", "10.96.0.0/16", "dev", "kpx0a0b0cf2"] in commands
    assert ["route", "replace", "fd00:96::/112", "dev", "kpx0a0b0cf2"] in commands
    # the link is up before anything routes over it
    up = commands.index(["link", "set", "kpx0a0b0cf2", "up"])
    assert up < commands.index(["route", "replace", "10.96.0.0/16", "dev", "kpx0a0b0cf2"])


def test_guest_macs_are_distinct_well_formed_and_locally_administered() -> None:
    macs = [guest_mac(i) for i in range(1, 251)]
    assert len(set(macs)) == len(macs)
    for mac in macs:
        octets = mac.split(":")
        assert len(octets) == 6 and all(len(o) == 2 for o in octets)
        int(mac.replace(":", ""), 16)
    assert guest_mac(2) == "52:54:00:24:02:02"


def test_a_guest_nodes_data_is_on_its_own_disk_and_its_files_on_the_share() -> None:
    share = Path("/dev/shm/kpx/c/nodes/node-1")
    # the host nodes' plan of test_real_node_config, as a guest node has it
    plan = dataclasses.replace(PLAN, dir=share, data_dir=GUEST_DATA / "node-1")
    for path in (plan.var_lib, plan.var_log, plan.sysctl_dir, plan.containerd_socket):
        assert GUEST_DATA in path.parents
    for path in (plan.kubelet_config, plan.kubeconfig, plan.log_dir, plan.spec_file):
        assert share in path.parents
    # the data directory is not below a path the node mounts over (it would hide itself)
    for mount in config.node_mounts(plan):
        assert Path(mount.target) not in GUEST_DATA.parents
        assert Path(mount.target) != GUEST_DATA


def _hierarchy(root: Path, controllers: str) -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("\n")
    return root


def test_cgroup_v2_delegates_every_controller_a_parent_has(tmp_path: Path) -> None:
    root = _hierarchy(tmp_path / "cg", "cpuset cpu io memory pids")
    cgroups._delegate(root)
    # the kernel takes "+a +b" and lists what is enabled; the fake keeps what was written
    assert (root / "cgroup.subtree_control").read_text() == "+cpuset +cpu +io +memory +pids"


def test_cgroup_v2_delegation_writes_only_what_is_missing(tmp_path: Path) -> None:
    root = _hierarchy(tmp_path / "cg", "cpu memory pids")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    cgroups._delegate(root)
    assert (root / "cgroup.subtree_control").read_text() == "+pids"


def test_a_v1_hierarchy_is_not_delegated(tmp_path: Path) -> None:
    v1 = tmp_path / "memory"
    v1.mkdir()
    cgroups._delegate(v1)
    assert not (v1 / "cgroup.subtree_control").exists()


def test_the_guest_finds_a_nic_by_its_mac(tmp_path: Path) -> None:
    for name, mac in (("eth0", "52:54:00:12:34:56"), ("eth1", "52:54:00:24:02:02")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "address").write_text(mac + "\n")
    assert guest_node.nic_with_mac("52:54:00:24:02:02", tmp_path) == "eth1"
    assert guest_node.nic_with_mac("52:54:00:24:02:02".upper(), tmp_path) == "eth1"
    with pytest.raises(guest_node.GuestNodeError, match="no interface has MAC"):
        guest_node.nic_with_mac("52:54:00:24:02:09", tmp_path)


def test_conformance_targets_take_ipvs_and_refuse_other_modes() -> None:
    assert Target.parse("kpx/ipvs") == Target("kpx", "ipvs")
    assert Target.parse("kube-proxy/ipvs").label == "kube-proxy-ipvs"
    with pytest.raises(Exception, match="MODE one of nftables, iptables, ipvs"):
        Target.parse("kpx/userspace")


def _archive(path: Path, annotations: dict[str, str] | None) -> str:
    import io
    import json
    import tarfile

    with tarfile.open(path, "w") as tar:
        if annotations is not None:
            data = json.dumps({"manifests": [{"annotations": annotations}]}).encode()
            info = tarfile.TarInfo("index.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_an_archives_image_name_is_what_containerd_lists_it_as(tmp_path: Path) -> None:
    """The supervisor skips an archive whose image the node's store already has by this name."""
    from kpx_cluster.kubelets.supervisor import archive_image_name

    named = {"io.containerd.image.name": "registry.k8s.io/pause:3.10.2"}
    assert (
        archive_image_name(_archive(tmp_path / "a.tar", named)) == named["io.containerd.image.name"]
    )
    ref = {"org.opencontainers.image.ref.name": "ghcr.io/kpx/kpx-agent:0.1.0"}
    assert archive_image_name(_archive(tmp_path / "b.tar", ref)) == "ghcr.io/kpx/kpx-agent:0.1.0"
    # a bare tag names no image; no index, or no archive at all: None (the archive is imported)
    tag_only = {"org.opencontainers.image.ref.name": "3.10.2"}
    assert archive_image_name(_archive(tmp_path / "c.tar", tag_only)) is None
    assert archive_image_name(_archive(tmp_path / "d.tar", None)) is None
    assert archive_image_name(str(tmp_path / "missing.tar")) is None


def _supervisor_waiting_on(tmp_path: Path, answers: list[object], start_s: float) -> object:
    """A supervisor whose `ctr version` gives `answers` in turn (an exception is raised) and whose
    containerd process keeps running."""
    import subprocess

    from kpx_cluster.kubelets.supervisor import Supervisor

    sup = Supervisor({"logDir": str(tmp_path), "containerdStartSeconds": start_s})
    containerd = subprocess.Popen(["sleep", "30"])
    sup.procs["containerd"] = containerd

    def ctr(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        assert args == ("version",) and timeout == 10
        answer = answers.pop(0) if answers else subprocess.TimeoutExpired("ctr", timeout)
        if isinstance(answer, BaseException):
            raise answer
        return subprocess.CompletedProcess(["ctr"], int(str(answer)), "", "")

    sup._ctr = ctr  # type: ignore[method-assign]
    return sup


def test_containerd_that_times_out_a_call_is_waited_for_not_given_up_on(tmp_path: Path) -> None:
    """Under the guest's emulation `ctr version` can hang while containerd loads its plugins: a
    call that times out means 'not yet', until the spec's containerdStartSeconds."""
    import subprocess

    hang = subprocess.TimeoutExpired("ctr", 10)
    answers: list[object] = [hang, 1, hang, 0]
    sup = _supervisor_waiting_on(tmp_path, answers, 60)
    try:
        sup._wait_containerd()  # type: ignore[attr-defined]
        assert answers == []
    finally:
        sup.procs["containerd"].kill()  # type: ignore[attr-defined]


def test_containerd_that_never_answers_fails_after_its_start_time_naming_the_log(
    tmp_path: Path,
) -> None:
    sup = _supervisor_waiting_on(tmp_path, [], 0.3)
    try:
        with pytest.raises(RuntimeError, match=r"within 0s; see .*containerd\.log"):
            sup._wait_containerd()  # type: ignore[attr-defined]
    finally:
        sup.procs["containerd"].kill()  # type: ignore[attr-defined]
