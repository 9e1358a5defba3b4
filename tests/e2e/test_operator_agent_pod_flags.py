"""The chart's agents.podAnnotations, podLabels and extraEnv, as the operator's flags
(--agent-pod-annotation, --agent-pod-label, --agent-env), against a real apiserver: the
operator's agents' DaemonSet, as the apiserver stores it, carries them beside the operator's
own; an operator given one of its own labels refuses to start, naming the flag."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest
from operator_process import NS, REPO, Operator, install, wait_until

from kpx_cluster.controlplane import Cluster

pytestmark = pytest.mark.e2e

NAME = f"podflags-{secrets.token_hex(3)}"


def test_the_agents_pods_carry_the_flags_values(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("agent-pod-flags")
    flags = (
        "--resync-interval=1",
        "--agent-pod-annotation=prometheus.io/scrape=true",
        "--agent-pod-label=team=net",
        "--agent-env=TZ=UTC",
    )
    op = Operator.start(install(cluster, workdir), workdir / "operator.log", *flags)
    pxc = {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": NAME},
        "spec": {"mode": "nftables", "nodeSelector": {"kpx.dev/none": NAME}},
    }
    ds_name = f"kpx-agent-{NAME}"
    try:
        cluster.kubectl("create", "-f", "-", input=json.dumps(pxc))

        def stored() -> dict[str, object] | None:
            out = cluster.kubectl(
                "-n", NS, "get", "daemonset", ds_name, "-o", "json", "--ignore-not-found"
            )
            return json.loads(out.stdout) if out.stdout.strip() else None

        ds = wait_until(stored, 60, f"DaemonSet {ds_name}")
    finally:
        op.stop()
        cluster.kubectl(
            "patch",
            "proxyconfiguration",
            NAME,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
        cluster.kubectl("delete", "proxyconfiguration", NAME, "--ignore-not-found", check=False)
        cluster.kubectl(
            "-n",
            NS,
            "delete",
            f"daemonset/{ds_name}",
            f"configmap/{ds_name}",
            "--ignore-not-found",
            check=False,
        )
    template = ds["spec"]["template"]  # type: ignore[index]
    assert template["metadata"]["labels"]["team"] == "net"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "kpx-agent"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "proxy.kpx.dev/restart-config-hash" in template["metadata"]["annotations"]
    (agent,) = [c for c in template["spec"]["containers"] if c["name"] == "agent"]
    assert agent["env"][-1] == {"name": "TZ", "value": "UTC"}
    assert agent["env"][0]["name"] == "NODE_NAME"


def test_an_operator_given_its_own_label_does_not_start() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kpx_operator", "--agent-pod-label=app.kubernetes.io/name=x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode == 2, run.stderr
    assert "argument --agent-pod-label: label app.kubernetes.io/name is the operator's own" in (
        run.stderr
    )
