"""Names, labels and annotations of everything the operator creates, in one place."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

FIELD_MANAGER: Final = "kpx-operator"
#: Finalizer on each ProxyConfiguration: released once its nodes are cleaned.
FINALIZER: Final = "proxy.kpx.dev/cleanup"
DEFAULT_NAMESPACE: Final = "kpx-system"
#: Lease the operator replicas compete for (in the operator's namespace).
LEASE_NAME: Final = "kpx-operator"

AGENT_APP: Final = "kpx-agent"
CLEANUP_APP: Final = "kpx-cleanup"

#: The agents' identity and permissions, installed with the operator (operator/manifests,
#: the chart), shared by the agents of every ProxyConfiguration: ServiceAccount `kpx-agent` in
#: the operator's namespace, ClusterRole and ClusterRoleBinding `kpx-agent`. The operator
#: creates, changes and deletes none of them (it holds no RBAC permission at all).
AGENT_SERVICE_ACCOUNT: Final = "kpx-agent"
AGENT_CLUSTER_ROLE: Final = "kpx-agent"

LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
#: The ProxyConfiguration a child (DaemonSet, ConfigMap) belongs to. Not app.kubernetes.io/instance:
#: an Argo CD Application that tracks by that label and shares the value would adopt the
#: children (no ownerReference, so they count as its own top-level resources) and prune them.
LABEL_CONFIGURATION: Final = "proxy.kpx.dev/configuration"
MANAGED_BY: Final = "kpx-operator"
PART_OF: Final = "kpx"

#: Pod-template annotation: hash of the agent configuration the agents read only at start.
RESTART_HASH_ANNOTATION: Final = "proxy.kpx.dev/restart-config-hash"

CONFIG_DIR: Final = "/etc/kpx"
CONFIG_KEY: Final = "config.yaml"
CONFIG_FILE: Final = f"{CONFIG_DIR}/{CONFIG_KEY}"

#: Child names and label values stay within 63 characters (a DNS label; label values too).
MAX_NAME: Final = 63


def bounded(prefix: str, name: str, limit: int = MAX_NAME) -> str:
    """``prefix + name``, or when longer than `limit` a truncated form ending in a hash of
    `name` (so two long names sharing a prefix still differ)."""
    full = prefix + name
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    head = full[: limit - len(digest) - 1].rstrip("-.")
    return f"{head}-{digest}"


@dataclass(frozen=True)
class ChildNames:
    """Names of the children of one ProxyConfiguration."""

    agent: str  # the agents' ConfigMap and DaemonSet
    cleanup: str  # the short-lived cleanup DaemonSet


def child_names(pxc_name: str) -> ChildNames:
    return ChildNames(
        agent=bounded(f"{AGENT_APP}-", pxc_name), cleanup=bounded(f"{CLEANUP_APP}-", pxc_name)
    )


def instance(pxc_name: str) -> str:
    """The app.kubernetes.io/instance label value of a ProxyConfiguration's children."""
    return bounded("", pxc_name)


def selector_labels(pxc_name: str, app: str) -> dict[str, str]:
    """The labels a DaemonSet selects its pods by (immutable once created)."""
    return {LABEL_NAME: app, LABEL_INSTANCE: instance(pxc_name)}


def labels(pxc_name: str, app: str) -> dict[str, str]:
    """The labels of the pods (the DaemonSet's selector, which is immutable, and more). Pods
    carry app.kubernetes.io/instance: their ownerReference (the DaemonSet) keeps GitOps tools
    from taking them for resources of their own."""
    return {
        **selector_labels(pxc_name, app),
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: PART_OF,
    }


def child_labels(pxc_name: str, app: str) -> dict[str, str]:
    """The labels of every child (DaemonSets, ConfigMaps): without app.kubernetes.io/instance
    (LABEL_CONFIGURATION says which ProxyConfiguration instead)."""
    return {
        LABEL_NAME: app,
        LABEL_CONFIGURATION: instance(pxc_name),
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: PART_OF,
    }
