"""What a real node is made of, as plain data: its plan (names, addresses, paths) and the
kubelet, containerd and CNI configurations built from it. No I/O here; `node.py` writes these
files and starts the processes.

A node's private directory holds everything that would be system-wide on a real machine; inside
the node's mount namespace it is mounted over /var/lib and /var/log (and a fresh tmpfs over
/run), so the kubelet and containerd use their usual paths. Only the containerd socket lives
where the host sees it, so the harness can import images with `ctr`.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: The pause image containerd's CRI runs as every pod's sandbox (built here, never pulled).
PAUSE_IMAGE: Final = "registry.k8s.io/pause:3.10.2"
CLUSTER_DNS: Final = "10.96.0.10"
CLUSTER_DOMAIN: Final = "cluster.local"
CNI_BIN_DIR: Final = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
NETWORK_NAME: Final = "kpx"

#: /proc/sys files the kubelet sets at start (pkg/kubelet/cm's setupKernelTunables) and the
#: values it wants. Files holding these values are bind-mounted over them in the node's mount
#: namespace, so it finds them set and the host's own values stay.
KUBELET_SYSCTLS: Final = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


@dataclass(frozen=True)
class NodePlan:
    """One real node: its Kubernetes name, netns, addresses, cgroup and private directory."""

    name: str
    netns: str
    ipv4: str
    ipv6: str
    pod_cidr_v4: str
    pod_cidr_v6: str
    gateway_v4: str
    gateway_v6: str
    cgroup: str  # top cgroup in every hierarchy, e.g. kpx1a2b3c-node-1
    dir: Path
    #: where the node's /var/lib, /var/log, sysctl files and containerd socket are, when not in
    #: `dir`: a node in the proxy-vm guest keeps them on the guest's own disk (`dir` is a 9p
    #: share there, on which containerd's overlayfs snapshotter and sockets do not work)
    data_dir: Path | None = None

    @property
    def data(self) -> Path:
        return self.data_dir or self.dir

    # -- paths on the host (the node dir is visible from both sides)
    @property
    def var_lib(self) -> Path:
        return self.data / "var-lib"

    @property
    def var_log(self) -> Path:
        return self.data / "var-log"

    @property
    def etc(self) -> Path:
        return self.dir / "etc"

    @property
    def sysctl_dir(self) -> Path:
        return self.data / "sysctl"

    @property
    def containerd_socket(self) -> Path:
        return self.data / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.etc / "containerd.toml"

    @property
    def kubelet_config(self) -> Path:
        return self.etc / "kubelet.yaml"

    @property
    def kubeconfig(self) -> Path:
        return self.etc / "kubelet.kubeconfig"

    @property
    def cni_conf_dir(self) -> Path:
        return self.etc / "cni"

    @property
    def resolv_conf(self) -> Path:
        return self.etc / "resolv.conf"

    @property
    def spec_file(self) -> Path:
        return self.dir / "node.json"

    @property
    def log_dir(self) -> Path:
        return self.dir / "logs"

    # -- what runs there
    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot: it creates kubepods/... below."""
        return f"/{self.cgroup}"

    @property
    def runtime_cgroup(self) -> str:
        """Where the node's own processes (containerd, shims, kubelet) run."""
        return f"{self.cgroup}/runtime"


def kubelet_config(plan: NodePlan, ca_file: Path) -> dict[str, Any]:
    """The KubeletConfiguration of `plan`'s kubelet (cgroup v1 hybrid, cgroupfs, no swap
    check, the node's own containerd, the cluster CA for clients, webhook authorization)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{plan.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": plan.cgroup_root,
        "failCgroupV1": False,
        "failSwapOn": False,
        "address": plan.ipv4,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [CLUSTER_DNS],
        "clusterDomain": CLUSTER_DOMAIN,
        # Pods never see the host's resolvers (no upstream DNS leaves the machine).
        "resolvConf": str(plan.resolv_conf),
        # The kubelet cannot lower its oom_score_adj here (no CAP_SYS_RESOURCE).
        "oomScoreAdj": 0,
        # Images are imported, never pulled: the kubelet must not collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "maxPods": 110,
        "registerNode": True,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "enableDebuggingHandlers": True,
        "containerLogMaxSize": "5Mi",
        "containerLogMaxFiles": 2,
    }


def kubelet_argv(plan: NodePlan, binary: Path) -> list[str]:
    return [
        str(binary),
        f"--config={plan.kubelet_config}",
        f"--kubeconfig={plan.kubeconfig}",
        f"--hostname-override={plan.name}",
        f"--node-ip={plan.ipv4},{plan.ipv6}",
        "--v=1",
    ]


def _toml(value: object) -> str:
    return json.dumps(value)  # strings, booleans and numbers: TOML's basic forms are JSON's


def containerd_config(plan: NodePlan) -> str:
    """containerd 1.6 (config version 2): root and state in the node's own /var/lib and /run,
    the socket in the node dir, CRI with runc under cgroupfs, `restrict_oom_score_adj` (no
    CAP_SYS_RESOURCE here: runc fails every sandbox without it), the pause image built here,
    CNI from the node's own conf dir."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    runc = f"{cri[:-1]}.containerd.runtimes.runc]"
    lines = [
        "version = 2",
        f"root = {_toml('/var/lib/containerd')}",
        f"state = {_toml('/run/containerd')}",
        "oom_score = 0",
        "[grpc]",
        f"  address = {_toml(str(plan.containerd_socket))}",
        "[ttrpc]",
        f"  address = {_toml(str(plan.containerd_socket) + '.ttrpc')}",
        "[debug]",
        '  address = ""',
        "[metrics]",
        '  address = ""',
        '[plugins."io.containerd.internal.v1.opt"]',
        f"  path = {_toml('/var/lib/containerd-opt')}",
        cri,
        f"  sandbox_image = {_toml(PAUSE_IMAGE)}",
        "  restrict_oom_score_adj = true",
        "  disable_apparmor = true",
        "  enable_selinux = false",
        "  tolerate_missing_hugetlb_controller = true",
        "  disable_hugetlb_controller = true",
        f"{cri[:-1]}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        runc,
        '  runtime_type = "io.containerd.runc.v2"',
        f"{runc[:-1]}.options]",
        "  SystemdCgroup = false",
        f"{cri[:-1]}.cni]",
        f"  bin_dir = {_toml(str(CNI_BIN_DIR))}",
        f"  conf_dir = {_toml(str(plan.cni_conf_dir))}",
        "  max_conf_num = 1",
        "",
    ]
    return "\n".join(lines)


#: Host numbers from this one on, in each node's pod CIDRs, are the harness's: its client
#: network namespaces (`Topology.add_pod`) take them; the CNI hands out those below.
HARNESS_POD_HOSTS_FROM: Final = 200


def _host(cidr: str, n: int) -> str:
    return str(ipaddress.ip_network(cidr).network_address + n)


def cni_conflist(plan: NodePlan) -> dict[str, Any]:
    """The node's CNI network: pods on the node's bridge cbr0 (the Topology made it, with the
    pod CIDRs' gateways), host-local addresses from the node's pod CIDRs, no masquerade (other
    nodes and the control plane route pod CIDRs), hairpin for a pod reaching itself through a
    Service, portmap for hostPort. The CNI's range ends below HARNESS_POD_HOSTS_FROM."""
    return {
        "cniVersion": "0.4.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cbr0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": "/var/lib/cni/networks",
                    "ranges": [
                        [
                            {
                                "subnet": plan.pod_cidr_v4,
                                "gateway": plan.gateway_v4,
                                "rangeEnd": _host(plan.pod_cidr_v4, HARNESS_POD_HOSTS_FROM - 1),
                            }
                        ],
                        [
                            {
                                "subnet": plan.pod_cidr_v6,
                                "gateway": plan.gateway_v6,
                                "rangeEnd": _host(plan.pod_cidr_v6, HARNESS_POD_HOSTS_FROM - 1),
                            }
                        ],
                    ],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }


def node_object(plan: NodePlan) -> dict[str, Any]:
    """The Node as the harness creates it before its kubelet starts: the pod CIDRs the node's
    CNI hands out (no controller allocates them), the kubelet registers into it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": plan.name, "labels": {"kubernetes.io/hostname": plan.name}},
        "spec": {"podCIDR": plan.pod_cidr_v4, "podCIDRs": [plan.pod_cidr_v4, plan.pod_cidr_v6]},
    }


@dataclass(frozen=True)
class Mount:
    """One mount the node's supervisor makes in its fresh mount namespace."""

    source: str
    target: str
    fstype: str = ""  # empty: a bind mount

    def argv(self) -> list[str]:
        if self.fstype:
            return ["mount", "-t", self.fstype, self.source, self.target]
        return ["mount", "--bind", self.source, self.target]


def node_mounts(plan: NodePlan) -> list[Mount]:
    """What makes the node's usual paths its own: /run fresh, /var/lib and /var/log from the
    node dir, the kubelet's sysctls as plain files."""
    mounts = [
        Mount("tmpfs", "/run", "tmpfs"),
        Mount(str(plan.var_lib), "/var/lib"),
        Mount(str(plan.var_log), "/var/log"),
    ]
    mounts += [
        Mount(str(plan.sysctl_dir / key.replace("/", ".")), f"/proc/sys/{key}")
        for key in KUBELET_SYSCTLS
    ]
    return mounts


def supervisor_argv(netns: str, spec_file: Path, python: str) -> list[str]:
    """The node supervisor's command in the node's netns and a fresh mount and UTS namespace
    (`ip netns exec` would remount /sys and hide /sys/fs/cgroup from the kubelet)."""
    return [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "--",
        python,
        "-m",
        "kpx_cluster.kubelets.supervisor",
        str(spec_file),
    ]


#: How long a host node's containerd may take to answer on its socket (seconds).
CONTAINERD_START_S = 60


def supervisor_spec(
    plan: NodePlan,
    kubelet: Path,
    containerd: Path,
    archives: list[Path],
    containerd_start_s: float = CONTAINERD_START_S,
) -> dict[str, Any]:
    """What `kpx_cluster.kubelets.supervisor` does inside the node's namespaces (JSON).

    `containerd_start_s`: how long containerd may take to answer on its socket (several times
    longer in the emulated IPVS guest).
    """
    return {
        "node": plan.name,
        "mounts": [m.__dict__ for m in node_mounts(plan)],
        "containerd": [str(containerd), f"--config={plan.containerd_config}"],
        "containerdSocket": str(plan.containerd_socket),
        "containerdStartSeconds": containerd_start_s,
        "archives": [str(a) for a in archives],
        "kubelet": kubelet_argv(plan, kubelet),
        "logDir": str(plan.log_dir),
    }
