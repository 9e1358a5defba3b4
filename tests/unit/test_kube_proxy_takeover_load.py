"""The pure parts of the takeover-under-load harness (issue #18): which iptables-save lines are
upstream kube-proxy's, and the kube-proxy DaemonSet the node simulator runs."""

from __future__ import annotations

import yaml

from kpx_cluster import upstream_kube_proxy
from kpx_cluster.migration_takeover import iptables_rules_of_kube_proxy

SAVE = """\
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
:KUBE-MARK-DROP - [0:0]
:CNI-HOSTPORT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j CNI-HOSTPORT
-A KUBE-SERVICES -d 10.96.0.10/32 -j KUBE-SVC-ABC
COMMIT
*filter
:INPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
-A INPUT -j KUBE-FIREWALL
COMMIT
"""


def test_kube_proxy_lines_are_its_chains_and_the_jumps_into_them() -> None:
    assert iptables_rules_of_kube_proxy(SAVE) == [
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-SVC-ABC - [0:0]",
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-A KUBE-SERVICES -d 10.96.0.10/32 -j KUBE-SVC-ABC",
    ]


def test_the_kubelets_chains_are_not_kube_proxys() -> None:
    kubelet_only = "\n".join(
        line for line in SAVE.splitlines() if "KUBE-S" not in line and "portals" not in line
    )
    assert iptables_rules_of_kube_proxy(kubelet_only) == []


def test_the_daemonset_runs_the_pinned_binary_as_kubeadm_configures_it() -> None:
    objs = {o["kind"]: o for o in upstream_kube_proxy.objects("iptables", 6443, {"pool": "a"})}
    ds = objs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = ds["containers"]
    assert container["image"] == "registry.k8s.io/kube-proxy:v1.36.2"
    assert container["command"][0] == "/usr/local/bin/kube-proxy"  # the image's, as kubeadm's
    assert container["command"][1:] == [
        "--config=/var/lib/kube-proxy/config.conf",
        "--hostname-override=$(NODE_NAME)",
    ]
    assert ds["hostNetwork"] is True and ds["nodeSelector"]["pool"] == "a"
    data = objs["ConfigMap"]["data"]
    config = yaml.safe_load(data["config.conf"])
    assert config["mode"] == "iptables" and config["clientConnection"]["kubeconfig"]
    kubeconfig = yaml.safe_load(data["kubeconfig.conf"])
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert objs["ClusterRoleBinding"]["roleRef"]["name"] == "system:node-proxier"
    nft = {o["kind"]: o for o in upstream_kube_proxy.objects("nftables", 1, {})}
    assert yaml.safe_load(nft["ConfigMap"]["data"]["config.conf"])["mode"] == "nftables"
