"""The real nodes' configuration builders (kpx_cluster.kubelets.config) and the static images'
OCI archives (kpx_cluster.kubelets.static_images): plain data, no root, no processes."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tomllib
from pathlib import Path

from kpx_cluster.kubelets import config, dns, static_images

PLAN = config.NodePlan(
    name="node-1",
    netns="kpx0a0b0c-n-node-1",
    ipv4="10.242.0.2",
    ipv6="fd00:242::2",
    pod_cidr_v4="10.244.2.0/24",
    pod_cidr_v6="fd00:244:2::/64",
    gateway_v4="10.244.2.1",
    gateway_v6="fd00:244:2::1",
    cgroup="kpx0a0b0c-node-1",
    dir=Path("/dev/shm/kpx/t/nodes/node-1"),
)


def test_kubelet_runs_on_cgroup_v1_with_cgroupfs_under_the_node_cgroup() -> None:
    cfg = config.kubelet_config(PLAN, Path("/pki/ca.crt"))
    assert cfg["failCgroupV1"] is False
    assert cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["cgroupRoot"] == "/kpx0a0b0c-node-1"
    assert cfg["failSwapOn"] is False
    assert cfg["containerRuntimeEndpoint"] == f"unix://{PLAN.containerd_socket}"
    assert cfg["authentication"]["x509"]["clientCAFile"] == "/pki/ca.crt"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["authorization"]["mode"] == "Webhook"
    # pods see the cluster's DNS, never the host's resolvers
    assert cfg["clusterDNS"] == [config.CLUSTER_DNS]
    assert cfg["resolvConf"] == str(PLAN.resolv_conf)
    assert PLAN.runtime_cgroup.startswith(PLAN.cgroup + "/")


def test_kubelet_argv_names_the_node_and_both_addresses() -> None:
    argv = config.kubelet_argv(PLAN, Path("/bin/kubelet"))
    assert "--hostname-override=node-1" in argv
    assert "--node-ip=10.242.0.2,fd00:242::2" in argv


def test_containerd_config_keeps_every_path_on_the_node_and_restricts_oom_score_adj() -> None:
    cfg = tomllib.loads(config.containerd_config(PLAN))
    assert cfg["version"] == 2
    assert cfg["root"] == "/var/lib/containerd"  # the node's own /var/lib (a bind mount)
    assert cfg["state"] == "/run/containerd"  # the node's own tmpfs
    assert cfg["grpc"]["address"] == str(PLAN.containerd_socket)
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == config.PAUSE_IMAGE
    assert cri["cni"]["conf_dir"] == str(PLAN.cni_conf_dir)
    assert cri["cni"]["bin_dir"] == str(config.CNI_BIN_DIR)
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False


def test_cni_puts_pods_on_cbr0_with_the_node_pod_cidrs_and_no_masquerade() -> None:
    conflist = config.cni_conflist(PLAN)
    bridge, portmap = conflist["plugins"]
    assert bridge["type"] == "bridge" and bridge["bridge"] == "cbr0"
    assert bridge["ipMasq"] is False and bridge["hairpinMode"] is True
    ranges = bridge["ipam"]["ranges"]
    # The CNI hands out host numbers below 200; the harness's client netns take 200 and up.
    assert ranges == [
        [{"subnet": "10.244.2.0/24", "gateway": "10.244.2.1", "rangeEnd": "10.244.2.199"}],
        [{"subnet": "fd00:244:2::/64", "gateway": "fd00:244:2::1", "rangeEnd": "fd00:244:2::c7"}],
    ]
    assert portmap["type"] == "portmap"


def test_node_object_carries_the_pod_cidrs() -> None:
    node = config.node_object(PLAN)
    assert node["metadata"]["name"] == "node-1"
    assert node["spec"]["podCIDRs"] == ["10.244.2.0/24", "fd00:244:2::/64"]


def test_node_mounts_replace_run_var_lib_var_log_and_the_kubelet_sysctls() -> None:
    mounts = {m.target: m for m in config.node_mounts(PLAN)}
    assert mounts["/run"].fstype == "tmpfs"
    assert mounts["/var/lib"].source == str(PLAN.var_lib)
    assert mounts["/var/log"].source == str(PLAN.var_log)
    for key in config.KUBELET_SYSCTLS:
        assert mounts[f"/proc/sys/{key}"].argv()[:2] == ["mount", "--bind"]
    # /run first: the rest must not be hidden under it
    assert config.node_mounts(PLAN)[0].target == "/run"


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        out = {}
        for m in tar.getmembers():
            f = tar.extractfile(m)
            out[m.name] = f.read() if f else b""
        return out


def test_an_oci_archive_names_its_image_for_containerd_and_its_blobs_match_their_digests() -> None:
    layer = static_images.layer_tar(static_images.pause_entries(b"\x7fELF..."))
    archive = static_images.oci_archive("example.org/pause:1.0", layer, {"Entrypoint": ["/pause"]})
    files = _members(archive)
    (manifest_ref,) = json.loads(files["index.json"])["manifests"]
    assert manifest_ref["annotations"]["io.containerd.image.name"] == "example.org/pause:1.0"
    assert manifest_ref["annotations"]["org.opencontainers.image.ref.name"] == "1.0"
    for name, data in files.items():
        if name.startswith("blobs/sha256/") and data:
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(files["blobs/sha256/" + manifest_ref["digest"][7:]])
    image_config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"][7:]])
    assert image_config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
    assert _members(layer)["pause"] == b"\x7fELF..."
    # reproducible: the same inputs give the same bytes
    assert archive == static_images.oci_archive(
        "example.org/pause:1.0", layer, {"Entrypoint": ["/pause"]}
    )


def test_busybox_layer_links_each_applet_to_the_one_binary() -> None:
    entries = static_images.busybox_entries(b"BB", ["/bin/sh", "/usr/bin/wget", "/bin/busybox"])
    by_path = {e.path: e for e in entries}
    assert by_path["bin/busybox"].data == b"BB"
    assert by_path["bin/sh"].link == "/bin/busybox"
    assert by_path["usr/bin/wget"].link == "/bin/busybox"
    assert by_path["usr"].data is None and by_path["usr/bin"].data is None
    assert by_path["tmp"].mode == 0o1777


def test_cluster_dns_is_the_kubelets_and_forwards_nowhere() -> None:
    objects = {o["kind"]: o for o in dns.dns_objects("10.242.0.1", "6443")}
    assert objects["Service"]["spec"]["clusterIP"] == config.CLUSTER_DNS
    assert "forward" not in dns.COREFILE  # no query leaves the machine
    assert f"kubernetes {config.CLUSTER_DOMAIN} " in dns.COREFILE
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == dns.COREDNS_IMAGE
    assert container["imagePullPolicy"] == "Never"
    # the apiserver's real address: the kubernetes Service answers only once a proxy runs
    assert {"name": "KUBERNETES_SERVICE_HOST", "value": "10.242.0.1"} in container["env"]


def test_coredns_version_is_the_toolchain_pin() -> None:
    go_mod = (Path(__file__).parents[2] / "toolchain" / "coredns" / "go.mod").read_text()
    assert f"require github.com/coredns/coredns {dns.COREDNS_VERSION}\n" in go_mod
