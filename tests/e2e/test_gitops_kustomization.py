"""examples/gitops, the kustomization a Flux Kustomization or an Argo CD Application points at,
against a real apiserver: applied server-side twice, the second `kubectl diff --server-side`
shows nothing; and the operator's children carry nothing that lets an Argo CD Application that
tracks by label (app.kubernetes.io/instance) take them for its own, although the
ProxyConfiguration carries that label (Argo CD sets it) and the Application shares its name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_process import NS, Operator, install, wait_until

from kpx_cluster.controlplane import Cluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
GITOPS = REPO / "examples" / "gitops"
PXC = "default"  # examples/gitops/proxyconfiguration.yaml
TRACKING_LABEL = "app.kubernetes.io/instance"  # Argo CD's application.instanceLabelKey default
APP = PXC  # an Argo CD Application named like the ProxyConfiguration (and its children's value)
Obj = dict[str, Any]


def apply(cluster: Cluster) -> Any:
    return cluster.kubectl(
        "apply", "--server-side", "--field-manager=gitops-e2e", "-k", str(GITOPS), check=False
    )


@pytest.fixture(scope="module")
def applied(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """examples/gitops applied twice (the first may meet a CRD not yet established, as a GitOps
    tool's first sync does: it tries again); at the end its ProxyConfiguration, the operator's
    Deployment and the children go, not the CRD, namespace and RBAC other modules share."""
    first = apply(cluster)
    if first.returncode != 0:
        assert "ensure CRDs are installed first" in first.stderr, first.stderr

        def established() -> bool:
            out = cluster.kubectl("get", "crd", "proxyconfigurations.proxy.kpx.dev", "-o", "json")
            conds = (json.loads(out.stdout).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        wait_until(established, 60, "CRD established")
        retried = apply(cluster)
        assert retried.returncode == 0, retried.stderr
    second = apply(cluster)
    try:
        yield second
    finally:
        # No operator left to release the finalizer; the children go by hand (other modules
        # make a ProxyConfiguration "default" of their own).
        cluster.kubectl(
            "patch",
            "proxyconfiguration",
            PXC,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
        cluster.kubectl("delete", "proxyconfiguration", PXC, "--ignore-not-found", check=False)
        cluster.kubectl(
            "-n",
            NS,
            "delete",
            "deployment/kpx-operator",
            f"daemonset/kpx-agent-{PXC}",
            f"configmap/kpx-agent-{PXC}",
            "--ignore-not-found",
            check=False,
        )


def test_applied_twice_server_side_with_no_diff(cluster: Cluster, applied: Any) -> None:
    assert applied.returncode == 0, applied.stderr
    rendered = list(yaml.safe_load_all(cluster.kubectl("kustomize", str(GITOPS)).stdout))
    kinds = {o["kind"] for o in rendered}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "ProxyConfiguration",
    } <= kinds
    # Nothing changed by the second apply: every line says "serverside-applied" or "unchanged".
    assert applied.stdout.strip(), applied
    diff = cluster.kubectl(
        "diff", "--server-side", "--field-manager=gitops-e2e", "-k", str(GITOPS), check=False
    )
    assert diff.returncode == 0, f"diff (exit {diff.returncode}):\n{diff.stdout}{diff.stderr}"
    assert diff.stdout == ""


def children(cluster: Cluster) -> list[Obj]:
    """What the operator made for PXC (names: docs/operator.md)."""
    out = cluster.kubectl(
        "-n",
        NS,
        "get",
        f"daemonset/kpx-agent-{PXC}",
        f"configmap/kpx-agent-{PXC}",
        "-o",
        "json",
        "--show-managed-fields",
        "--ignore-not-found",
    )
    return list(json.loads(out.stdout)["items"]) if out.stdout.strip() else []


def test_children_cannot_be_taken_by_an_argocd_application_tracking_by_label(
    cluster: Cluster, applied: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # What Argo CD's label tracking sets on what it syncs (and annotation tracking), before the
    # operator sees the object: the operator never saw it without them.
    cluster.kubectl("label", "--overwrite", "proxyconfiguration", PXC, f"{TRACKING_LABEL}={APP}")
    cluster.kubectl(
        "annotate",
        "--overwrite",
        "proxyconfiguration",
        PXC,
        f"argocd.argoproj.io/tracking-id={APP}:proxy.kpx.dev/ProxyConfiguration:/{PXC}",
    )
    workdir = tmp_path_factory.mktemp("gitops-kustomization")
    op = Operator.start(install(cluster, workdir), workdir / "operator.log", "--resync-interval=1")
    try:

        def acted() -> list[Obj] | None:
            pxc = json.loads(cluster.kubectl("get", "pxc", PXC, "-o", "json").stdout)
            written = (pxc.get("status") or {}).get("observedGeneration")
            found = children(cluster)
            kinds = sorted(o["kind"] for o in found)
            return found if written and kinds == ["ConfigMap", "DaemonSet"] else None

        found = wait_until(acted, 60, "the operator's children of the labelled object")
    finally:
        op.stop()
    for obj in found:
        meta = obj["metadata"]
        where = f"{obj['kind']} {meta['name']}"
        # Argo CD tracks only objects without ownerReferences: these have none (the finalizer
        # decides their fate), so nothing may mark them as an Application's.
        assert "ownerReferences" not in meta, where
        assert TRACKING_LABEL not in (meta.get("labels") or {}), where
        annotations = meta.get("annotations") or {}
        assert not [k for k in annotations if k.startswith("argocd.argoproj.io/")], where
        assert "kubectl.kubernetes.io/last-applied-configuration" not in annotations, where
        assert not {(m["manager"], m["operation"]) for m in meta["managedFields"]} - {
            ("kpx-operator", "Apply"),
            ("kube-controller-manager", "Update"),
        }, where
    # The label the selector of the agents' pods needs stays on the pod template only.
    (ds,) = [o for o in found if o["kind"] == "DaemonSet"]
    assert ds["spec"]["template"]["metadata"]["labels"][TRACKING_LABEL] == PXC
