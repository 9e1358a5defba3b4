"""`proxy-agent convert-kube-proxy-config` against a real kube-apiserver, as docs/install.md runs
it: kubeadm v1.36's default kube-system/kube-proxy ConfigMap is created, read back with
`kubectl get -o yaml`, converted, and the ProxyConfiguration applied: the CRD's validation
accepts it and the stored spec is the converted one."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_cluster.controlplane import Cluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
KUBEADM = REPO / "tests" / "unit" / "kube_proxy_configs" / "kubeadm-v1.36-kube-proxy-configmap.yaml"
NS = f"kpconv-{secrets.token_hex(3)}"  # stands in for kube-system (left alone)


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Iterator[Cluster]:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/proxyconfigurations.proxy.kpx.dev",
    )
    cluster.create_namespace(NS)
    try:
        yield cluster
    finally:
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def convert(text: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpx_agent.cli", "convert-kube-proxy-config", *args],
        input=text,
        capture_output=True,
        text=True,
        check=False,
    )


def applied(api: Cluster, pxc: dict[str, Any]) -> dict[str, Any]:
    """Create `pxc` (a unique name), return it as stored, delete it."""
    api.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pxc))
    name = pxc["metadata"]["name"]
    try:
        return dict(json.loads(api.kubectl("get", "pxc", name, "-o", "json").stdout))
    finally:
        api.kubectl("delete", "pxc", name, "--wait=false", check=False)


def test_kubeadms_default_configmap_converts_to_a_proxyconfiguration_the_apiserver_keeps(
    api: Cluster,
) -> None:
    configmap = yaml.safe_load(KUBEADM.read_text())
    configmap["metadata"]["namespace"] = NS
    api.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(configmap))
    text = api.kubectl("-n", NS, "get", "configmap", "kube-proxy", "-o", "yaml").stdout
    name = f"kpconv-{secrets.token_hex(3)}"
    out = convert(text, "--takeover", "--name", name)
    assert out.returncode == 0, out.stderr
    assert "NOT CARRIED" not in out.stderr
    pxc = yaml.safe_load(out.stdout)
    stored = applied(api, pxc)
    spec = stored["spec"]
    assert {k: spec[k] for k in pxc["spec"]} == pxc["spec"]  # every converted value kept as is
    assert spec["mode"] == "iptables"
    assert spec["clusterCIDRs"] == ["10.244.0.0/16"]
    assert spec["takeover"] == {"fromKubeProxy": True, "moveKubeProxyOff": True}


def test_to_nftables_names_what_it_changes_and_the_apiserver_keeps_the_result(
    api: Cluster,
) -> None:
    name = f"kpconv-{secrets.token_hex(3)}"
    out = convert(KUBEADM.read_text(), "--to-nftables", "--takeover", "--name", name)
    assert out.returncode == 1  # kube-proxy's localhost NodePorts and all-local-IPs NodePorts
    assert "NOT CARRIED: iptables.localhostNodePorts" in out.stderr
    assert "NOT CARRIED: nodePortAddresses" in out.stderr
    pxc = yaml.safe_load(out.stdout)
    stored = applied(api, pxc)["spec"]
    assert stored["mode"] == "nftables" and "iptables" not in stored
    assert {k: stored[k] for k in pxc["spec"]} == pxc["spec"]


def test_ipvs_with_masquerade_all_converts_and_the_apiserver_keeps_it(api: Cluster) -> None:
    doc = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "ipvs",
        "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
        "iptables": {"masqueradeAll": True, "masqueradeBit": 9},
        "ipvs": {"scheduler": "wrr", "strictARP": True, "excludeCIDRs": ["10.200.0.0/16"]},
        "conntrack": {"maxPerCore": 0},
        "bindAddressHardFail": True,
    }
    name = f"kpconv-{secrets.token_hex(3)}"
    out = convert(yaml.safe_dump(doc), "--name", name)
    assert out.returncode == 1  # bindAddressHardFail is not carried
    assert "NOT CARRIED: bindAddressHardFail" in out.stderr
    pxc = yaml.safe_load(out.stdout)
    stored = applied(api, pxc)["spec"]
    assert stored["ipvs"]["masqueradeAll"] is True
    assert stored["ipvs"]["masqueradeBit"] == 9
    assert stored["ipvs"]["acknowledgeDeprecation"] is True
    assert {k: stored[k] for k in pxc["spec"]} == pxc["spec"]


def test_a_conversion_the_crd_would_refuse_is_refused_before_applying(api: Cluster) -> None:
    doc = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "nftables": {"syncPeriod": "10s", "minSyncPeriod": "20s"},
    }
    out = convert(yaml.safe_dump(doc))
    assert out.returncode == 2
    assert "minSyncPeriod must not be greater than syncPeriod" in out.stderr
    # the apiserver says the same of that spec
    spec = {"mode": "nftables", "nftables": {"syncPeriod": "10s", "minSyncPeriod": "20s"}}
    pxc = {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": f"kpconv-{secrets.token_hex(3)}"},
        "spec": spec,
    }
    refused = api.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(pxc), check=False
    )
    assert refused.returncode != 0
    assert "minSyncPeriod must not be greater than syncPeriod" in refused.stderr
