"""`proxy-cluster up --nodes 1` and `down`, as a user runs them from a shell: `up` returns with
the node Ready and a background process owning it; when that process is killed outright
(SIGKILL: no cleanup of its own), `down` still removes every process, netns, cgroup and file
the cluster had."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kpx_cluster import netns
from kpx_cluster.controlplane import DEFAULT_ROOT, Cluster
from kpx_cluster.kubelets import background, cgroups

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


def proxy_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpx_cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=netns.python_env(),
        check=False,
    )


def test_down_removes_everything_even_after_the_owner_was_killed() -> None:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root", pytrace=False)
    name, root = f"cli-{os.getpid()}", DEFAULT_ROOT  # tmpfs: etcd's WAL
    prefix = "kpx-none"
    try:
        up = proxy_cluster("--name", name, "--root", str(root), "up", "--nodes", "1")
        assert up.returncode == 0, up.stderr
        assert up.stdout.splitlines()[-1] == f"export KUBECONFIG={root / name}/admin.kubeconfig"
        cluster = Cluster(name, root)
        nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        assert [n["metadata"]["name"] for n in nodes] == ["node-1"]
        prefix = json.loads((cluster.state_dir / "real-nodes.json").read_text())["prefix"]
        assert netns.leftovers(prefix)  # the namespaces exist while it runs
        owner = background.running_pid(background.Files.of(name, root))
        assert owner is not None
        os.kill(owner, signal.SIGKILL)
        while background.running_pid(background.Files.of(name, root)) is not None:
            time.sleep(0.1)
    finally:
        down = proxy_cluster("--name", name, "--root", str(root), "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert netns.leftovers(prefix) == []
    assert cgroups.leftovers(prefix) == []
    assert not (root / name).exists()
    assert not background.Files.of(name, root).dir.exists()
    state = str(root / name)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            assert state not in cmdline and prefix not in cmdline, cmdline
