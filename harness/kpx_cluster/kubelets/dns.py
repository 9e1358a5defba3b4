"""Cluster DNS for the real nodes: CoreDNS (built from its Go module, toolchain/coredns) as
kubeadm deploys it, without upstream forwarding (no query leaves the machine). Pure builders of
the objects; `cluster.RealCluster` applies them.

CoreDNS talks to the apiserver at its real address (the control plane's fabric address), not
through the `kubernetes` Service: the Service's address answers only once a service proxy (kpx)
runs, and DNS must not wait for it. The `kube-dns` Service (10.96.0.10, the kubelets'
clusterDNS) answers through the service proxy like any other.
"""

from __future__ import annotations

from typing import Any, Final

from .config import CLUSTER_DNS, CLUSTER_DOMAIN

COREDNS_VERSION: Final = "v1.14.2"  # toolchain/coredns/go.mod (a unit test keeps them in step)
COREDNS_IMAGE: Final = f"registry.k8s.io/coredns/coredns:{COREDNS_VERSION}"
NAMESPACE: Final = "kube-system"
LABELS: Final = {"k8s-app": "kube-dns"}

COREFILE: Final = f""".:53 {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    prometheus :9153
    cache 30
    loop
    reload
}}
"""


def dns_objects(
    apiserver_host: str, apiserver_port: str, replicas: int = 1
) -> list[dict[str, Any]]:
    """ServiceAccount, RBAC, Corefile, Deployment and the kube-dns Service."""
    meta = {"namespace": NAMESPACE, "labels": dict(LABELS)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", **meta}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "coredns", "namespace": NAMESPACE},
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "coredns", **meta},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": dict(LABELS)},
                "template": {
                    "metadata": {"labels": dict(LABELS)},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "priorityClassName": "system-cluster-critical",
                        "dnsPolicy": "Default",
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [
                            {
                                "name": "coredns",
                                "image": COREDNS_IMAGE,
                                "imagePullPolicy": "Never",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                "env": [
                                    {"name": "KUBERNETES_SERVICE_HOST", "value": apiserver_host},
                                    {"name": "KUBERNETES_SERVICE_PORT", "value": apiserver_port},
                                ],
                                "ports": [
                                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                    {"name": "metrics", "containerPort": 9153, "protocol": "TCP"},
                                ],
                                "volumeMounts": [
                                    {
                                        "name": "config",
                                        "mountPath": "/etc/coredns",
                                        "readOnly": True,
                                    }
                                ],
                                "livenessProbe": {
                                    "httpGet": {"path": "/health", "port": 8080},
                                    "periodSeconds": 10,
                                },
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": 8181},
                                    "periodSeconds": 1,
                                },
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", **meta},
            "spec": {
                "selector": dict(LABELS),
                "clusterIP": CLUSTER_DNS,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                    {"name": "metrics", "port": 9153, "protocol": "TCP"},
                ],
            },
        },
    ]
