"""`make demo` as a new user runs it: three real kubelet nodes, kpx from its images, the demo
app; `up` shows every backend answering through the Service IPs and a NodePort, the
ProxyConfiguration reads healthy, and `down` leaves nothing behind. Runs under a cluster name
of its own (KPX_DEMO_CLUSTER) so it never touches a user's demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from kpx_cluster import images
from kpx_cluster.controlplane import DEFAULT_ROOT, Cluster
from kpx_cluster.demo import unhealthy_conditions
from kpx_cluster.netns import python_env

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


def demo(command: str, name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpx_cluster.demo", command],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**python_env(), "KPX_DEMO_CLUSTER": name},
    )


def test_make_demo_runs_on_real_kubelets_and_reads_healthy() -> None:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    if images.missing(directory=images.archives_dir()):
        pytest.fail("the kpx images are missing or stale: run `make image`", pytrace=False)
    name = f"demo-test-{os.getpid()}"
    try:
        up = demo("up", name, 600)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        out = up.stdout
        # six requests through the IPv4 ClusterIP from the client pod: every answer is a
        # backend's pod name; the IPv6 ClusterIP and the NodePort (from node-2) answer too
        answers = re.findall(r"^  (web-\S+)$", out, re.MULTILINE)
        assert len(answers) >= 8, out
        assert "(no answer" not in out, out
        pods = json.loads(
            Cluster(name).kubectl("-n", "demo", "get", "pods", "-l", "app=web", "-o", "json").stdout
        )["items"]
        assert {p["spec"]["nodeName"] for p in pods} == {"node-1", "node-2", "node-3"}
        assert set(answers) <= {p["metadata"]["name"] for p in pods}
        pxc = json.loads(Cluster(name).kubectl("get", "pxc", "default", "-o", "json").stdout)
        conditions = {c["type"]: c for c in pxc["status"]["conditions"]}
        assert conditions["Ready"]["status"] == "True", pxc["status"]
        assert conditions["Ready"]["observedGeneration"] == pxc["metadata"]["generation"]
        # a new user's first `kubectl get pxc -o yaml` reads healthy: every condition reads as
        # when all is well (demo.HEALTHY: Degraded, Progressing, Deprecated, Reconciling and
        # Stalled False, no ConntrackNotApplied), and the demo printed no NOT HEALTHY line
        assert unhealthy_conditions(pxc) == {}, pxc["status"]
        assert conditions["Degraded"]["reason"] != "ConntrackNotApplied", pxc["status"]
        assert "NOT HEALTHY" not in out, out
    finally:
        down = demo("down", name, 240)
    assert down.returncode == 0, down.stderr
    assert not Cluster(name).is_running()
    assert "could not remove" not in down.stderr, down.stderr
    # `down` keeps the demo's log for its user to read, and nothing else
    state = DEFAULT_ROOT / f"demo-{name}"
    assert sorted(p.name for p in state.iterdir()) == ["demo.log"]
    shutil.rmtree(state)
