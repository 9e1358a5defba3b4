"""`proxy-agent explain-migration` against a real apiserver: it lists the cluster's Services
and names the ones whose behaviour changes with the move from ipvs to nftables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from agent_harness import Kube

from kpx_cluster.controlplane import Cluster

pytestmark = pytest.mark.e2e


def test_explain_migration_names_this_clusters_services(
    cluster: Cluster, kube: Kube, tmp_path: Path
) -> None:
    ns = kube.create_namespace(prefix="mig")
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "sticky", "namespace": ns},
            "spec": {"sessionAffinity": "ClientIP", "ports": [{"port": 80}]},
        }
    )
    config = tmp_path / "ipvs.yaml"
    config.write_text(
        "apiVersion: proxy.kpx.dev/v1alpha1\nkind: AgentConfiguration\nmode: ipvs\n"
        "ipvs:\n  acknowledgeDeprecation: true\n  scheduler: sh\n  udpTimeout: 30s\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kpx_agent.cli",
            "explain-migration",
            "--from",
            "ipvs",
            "--to",
            "nftables",
            "--config",
            str(config),
            "--kubeconfig",
            str(cluster.kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "- scheduler: ipvs balances with sh" in result.stdout
    assert "udpTimeout=30s" in result.stdout
    assert f"{ns}/sticky" in result.stdout.split("- session affinity:")[1]
