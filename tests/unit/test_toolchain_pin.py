"""The harness runs the Kubernetes release that toolchain/kubernetes/go.mod pins."""

from __future__ import annotations

import re
from pathlib import Path

from kpx_cluster.binaries import KUBERNETES_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_pinned_version_matches_go_mod() -> None:
    go_mod = (REPO / "toolchain" / "kubernetes" / "go.mod").read_text()
    pinned = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes (v\S+)$", go_mod, re.M)
    assert pinned is not None, "go.mod does not require k8s.io/kubernetes"
    assert pinned.group(1) == KUBERNETES_VERSION
    # Every staging module is replaced by the published module of the same release.
    minor = KUBERNETES_VERSION.removeprefix("v1.")
    replaces = re.findall(r"^\s*(k8s\.io/\S+) => (k8s\.io/\S+) (v\S+)$", go_mod, re.M)
    assert len(replaces) > 20
    assert {v for _, _, v in replaces} == {f"v0.{minor}"}
