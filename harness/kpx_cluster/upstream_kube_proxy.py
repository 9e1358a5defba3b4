"""Upstream kube-proxy as kubeadm deploys it, for the node simulator (issue #18).

`objects(mode, apiserver_port, node_selector)` is what kubeadm creates for kube-proxy, with the
pinned binary: the ServiceAccount `kube-system/kube-proxy` bound to the bootstrap ClusterRole
`system:node-proxier`, the ConfigMap `kube-system/kube-proxy` (`config.conf`, a
KubeProxyConfiguration, and `kubeconfig.conf`) and the DaemonSet `kube-system/kube-proxy`
(hostNetwork, `--config=/var/lib/kube-proxy/config.conf --hostname-override=$(NODE_NAME)`).

The container's image is `IMAGE` (registry.k8s.io/kube-proxy at the pinned version), which
`make image` builds from the kube-proxy binary `make setup` compiled from the pinned Kubernetes
module (`images.build_kube_proxy`, images/upstream-kube-proxy/Containerfile: the binary at
/usr/local/bin/kube-proxy with iptables, nft, conntrack and ipset, as upstream's image); the
node simulator runs it under runc, privileged, in the node's netns. Two differences from
kubeadm's, kept from when it ran as a host process (the process runtime maps mount paths in argv
and workingDir but not inside files): `clientConnection.kubeconfig` is `kubeconfig.conf`,
relative to the working directory `/var/lib/kube-proxy`, and the kubeconfig names the token and
CA by paths relative to itself (`../kube-proxy-token/...`, a projected volume mounted at
`/var/lib/kube-proxy-token`), where kubeadm's uses the ServiceAccount mount's absolute paths.
Both resolve the same on a real node. The server is the apiserver on the node's loopback, as
the simulator exposes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import yaml

from .binaries import KUBERNETES_VERSION

NAME: Final = "kube-proxy"
NAMESPACE: Final = "kube-system"
LABELS: Final = {"k8s-app": "kube-proxy"}
IMAGE: Final = f"registry.k8s.io/kube-proxy:{KUBERNETES_VERSION}"
CONFIG_DIR: Final = "/var/lib/kube-proxy"
TOKEN_DIR: Final = "/var/lib/kube-proxy-token"  # noqa: S105 - a path
Obj = dict[str, Any]


def config(mode: str, cluster_cidr: str, conntrack_timeouts: bool = False) -> Obj:
    """The KubeProxyConfiguration (kubeadm's defaults, `mode` and `clusterCIDR` set). The
    conntrack table size is left to the kernel (maxPerCore 0, as kind does): nf_conntrack_max
    is global, the nodes share the host's kernel. So are the timeouts (0), unless
    `conntrack_timeouts`: then kube-proxy's defaults (established 24 h, CLOSE_WAIT 1 h), which
    it sets in the node's own network namespace (real nodes; the KubeProxy CLOSE_WAIT spec)."""
    conntrack: Obj = {"maxPerCore": 0}
    if not conntrack_timeouts:
        conntrack |= {"tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "bindAddress": "0.0.0.0",  # noqa: S104 - kubeadm's
        "clientConnection": {"kubeconfig": "kubeconfig.conf"},
        "clusterCIDR": cluster_cidr,
        "conntrack": conntrack,
        "mode": mode,
    }


def kubeconfig(apiserver_port: int, server: str = "") -> Obj:
    """`server` (an https URL) replaces the node's loopback (the simulator's apiserver)."""
    token = TOKEN_DIR.rsplit("/", 1)[1]
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "default",
                "cluster": {
                    "certificate-authority": f"../{token}/ca.crt",
                    "server": server or f"https://127.0.0.1:{apiserver_port}",
                },
            }
        ],
        "contexts": [
            {
                "name": "default",
                "context": {"cluster": "default", "namespace": "default", "user": "default"},
            }
        ],
        "current-context": "default",
        "users": [{"name": "default", "user": {"tokenFile": f"../{token}/token"}}],
    }


def objects(
    mode: str,
    apiserver_port: int,
    node_selector: Mapping[str, str],
    cluster_cidr: str = "10.244.0.0/16",
    server: str = "",
    conntrack_timeouts: bool = False,
) -> list[Obj]:
    """ServiceAccount, ClusterRoleBinding, ConfigMap and DaemonSet of kube-proxy in `mode`
    (iptables, nftables, or ipvs: on nodes whose kernel has IPVS, the proxy-vm guest's) on the
    nodes matching `node_selector`; `server`: the apiserver's URL when it is not on the node's
    loopback (real nodes)."""
    if mode not in ("iptables", "nftables", "ipvs"):
        raise ValueError(f"kube-proxy mode {mode!r}: iptables, nftables or ipvs")
    meta = {"name": NAME, "namespace": NAMESPACE, "labels": dict(LABELS)}
    kubeconfig_text = yaml.safe_dump(kubeconfig(apiserver_port, server), sort_keys=False)
    config_text = yaml.safe_dump(config(mode, cluster_cidr, conntrack_timeouts), sort_keys=False)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node-proxier",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {
                "config.conf": config_text,
                "kubeconfig.conf": kubeconfig_text,
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": dict(LABELS)},
                "updateStrategy": {"type": "RollingUpdate"},
                "template": {
                    "metadata": {"labels": dict(LABELS)},
                    "spec": {
                        "hostNetwork": True,
                        "priorityClassName": "system-node-critical",
                        "serviceAccountName": NAME,
                        "automountServiceAccountToken": False,
                        "nodeSelector": {"kubernetes.io/os": "linux", **node_selector},
                        "tolerations": [{"operator": "Exists"}],
                        "terminationGracePeriodSeconds": 1,
                        "containers": [
                            {
                                "name": NAME,
                                "image": IMAGE,
                                "command": [
                                    "/usr/local/bin/kube-proxy",
                                    f"--config={CONFIG_DIR}/config.conf",
                                    "--hostname-override=$(NODE_NAME)",
                                ],
                                "workingDir": CONFIG_DIR,
                                "env": [
                                    {
                                        "name": "NODE_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                    }
                                ],
                                "securityContext": {"privileged": True},
                                "volumeMounts": [
                                    {"name": "kube-proxy", "mountPath": CONFIG_DIR},
                                    {
                                        "name": "kube-proxy-token",
                                        "mountPath": TOKEN_DIR,
                                        "readOnly": True,
                                    },
                                    {"name": "xtables-lock", "mountPath": "/run/xtables.lock"},
                                    {
                                        "name": "lib-modules",
                                        "mountPath": "/lib/modules",
                                        "readOnly": True,
                                    },
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "kube-proxy", "configMap": {"name": NAME}},
                            {
                                "name": "kube-proxy-token",
                                "projected": {
                                    "sources": [
                                        {
                                            "serviceAccountToken": {
                                                "path": "token",
                                                "expirationSeconds": 3607,
                                            }
                                        },
                                        {
                                            "configMap": {
                                                "name": "kube-root-ca.crt",
                                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                            }
                                        },
                                    ]
                                },
                            },
                            {
                                "name": "xtables-lock",
                                "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"},
                            },
                            {"name": "lib-modules", "hostPath": {"path": "/lib/modules"}},
                        ],
                    },
                },
            },
        },
    ]
