"""Where the pinned Kubernetes binaries and etcd live (built by toolchain/build-kubernetes.sh)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The release pinned in toolchain/kubernetes/go.mod (a unit test keeps the two in step).
KUBERNETES_VERSION = "v1.36.2"


class MissingBinary(RuntimeError):
    """A binary the local cluster needs is not built or installed; says how to get it."""


def cache_dir() -> Path:
    return Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))


def kubernetes_bin_dir() -> Path:
    return cache_dir() / "bin" / KUBERNETES_VERSION


def kubernetes_binary(name: str) -> Path:
    """Path of a pinned Kubernetes binary such as kube-apiserver or kubectl."""
    path = kubernetes_bin_dir() / name
    if not os.access(path, os.X_OK):
        raise MissingBinary(
            f"{name} {KUBERNETES_VERSION} is not built ({path} missing): run `make setup` "
            f"(or toolchain/build-kubernetes.sh {name})"
        )
    return path


def etcd_binary() -> Path:
    found = shutil.which("etcd")
    if found is None:
        raise MissingBinary("etcd is not installed: run `make setup` (Debian package etcd-server)")
    return Path(found)
