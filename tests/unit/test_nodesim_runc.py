"""The node simulator's runc runtime: which images run how, container ids, bind mounts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kpx_cluster import oci
from kpx_cluster.nodesim.runc import ImagePullError, RuncRuntime, container_id, mounts


def _runtime(tmp_path: Path) -> RuncRuntime:
    store = oci.ImageStore(tmp_path / "store")
    store.refs["ghcr.io/kpx/kpx-agent:0.1.0"] = tmp_path / "agent.tar"
    return RuncRuntime(store, tmp_path / "state", frozenset({"python"}))


def test_built_images_run_under_runc_harness_images_as_processes(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    assert runtime.decide("ghcr.io/kpx/kpx-agent:0.1.0") == "runc"
    assert runtime.decide("python") == "process"


def test_other_images_cannot_be_pulled(tmp_path: Path) -> None:
    with pytest.raises(ImagePullError, match=r'"ghcr.io/kpx/kpx-agent:9.9.9" is not among'):
        _runtime(tmp_path).decide("ghcr.io/kpx/kpx-agent:9.9.9")


def test_unpack_failures_are_pull_errors(tmp_path: Path) -> None:
    with pytest.raises(ImagePullError, match="cannot be unpacked"):
        _runtime(tmp_path).unpack("ghcr.io/kpx/kpx-agent:0.1.0")  # the archive does not exist


def test_container_ids_are_runc_safe_and_unique_per_run() -> None:
    one = container_id("kpx-agent-x7/..", "0123456789ab", "agent", 0)
    assert one == "kpx-agent-x7-.._agent_01234567_0"
    assert container_id("kpx-agent-x7/..", "0123456789ab", "agent", 1) != one
    assert "/" not in one


def test_volume_mounts_bind_the_backing_directories(tmp_path: Path) -> None:
    pod_spec = {
        "volumes": [
            {"name": "token", "projected": {"sources": []}},
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "lock", "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"}},
            {"name": "modules", "hostPath": {"path": "/lib/modules"}},
            {"name": "scratch", "emptyDir": {}},
        ]
    }
    container = {
        "volumeMounts": [
            {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
            {"name": "cfg", "mountPath": "/etc/kpx/config.yaml", "subPath": "config.yaml"},
            {"name": "lock", "mountPath": "/run/xtables.lock"},
            {"name": "modules", "mountPath": "/lib/modules", "readOnly": True},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "undeclared", "mountPath": "/nowhere"},
        ]
    }
    dirs = {n: tmp_path / n for n in ("token", "cfg", "lock", "modules", "scratch")}
    got = mounts(pod_spec, container, dirs)
    assert got == [
        oci.Mount(str(tmp_path / "token"), "/var/run/secrets/kubernetes.io/serviceaccount", True),
        oci.Mount(str(tmp_path / "cfg" / "config.yaml"), "/etc/kpx/config.yaml", True),
        oci.Mount(str(tmp_path / "lock"), "/run/xtables.lock", False),
        oci.Mount(str(tmp_path / "modules"), "/lib/modules", True),
        oci.Mount(str(tmp_path / "scratch"), "/scratch", False),
    ]
