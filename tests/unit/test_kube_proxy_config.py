"""Converting kube-proxy's configuration (kubeadm's kube-proxy ConfigMap) into a
ProxyConfiguration: every field of v1alpha1 KubeProxyConfiguration is carried or named."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_agent.cli import main
from kpx_agent.handover.kube_proxy_config import (
    BLOCK_FIELDS,
    TOP_FIELDS,
    ConversionError,
    convert,
    read_document,
)

CONFIGS = Path(__file__).with_name("kube_proxy_configs")
KUBEADM = CONFIGS / "kubeadm-v1.36-kube-proxy-configmap.yaml"
WRITTEN = CONFIGS / "kube-proxy-v1.36.2-write-config-to.yaml"
BASE = {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration"}


def spec_of(**fields: Any) -> dict[str, Any]:
    return dict(convert({**BASE, **fields}).proxy_configuration["spec"])


def dropped_of(**fields: Any) -> dict[str, bool]:
    """Field -> lost, of what is not carried (maxPerCore 0 unless given: its note aside)."""
    doc = {**BASE, "conntrack": {"maxPerCore": 0}, **fields}
    return {d.field: d.lost for d in convert(doc).dropped}


def test_kubeadm_default_configmap_is_kube_proxys_defaults_made_explicit() -> None:
    conversion = convert(read_document(KUBEADM.read_text()))
    assert conversion.proxy_configuration == {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": "default"},
        "spec": {
            "mode": "iptables",
            "iptables": {
                "masqueradeBit": 14,
                "masqueradeAll": False,
                "localhostNodePorts": True,
                "syncPeriod": "30s",
                "minSyncPeriod": "1s",
            },
            "clusterCIDRs": ["10.244.0.0/16"],
            "nodePortAddresses": [],
            "detectLocal": {"mode": "ClusterCIDR"},
            "conntrack": {
                "maxPerCore": 32768,
                "min": 131072,
                "tcpEstablishedTimeout": "24h",
                "tcpCloseWaitTimeout": "1h",
                "tcpBeLiberal": False,
                "udpTimeout": "0s",
                "udpStreamTimeout": "0s",
            },
            "healthzBindAddress": "0.0.0.0:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"operator": "Exists"}],
        },
    }
    assert conversion.lost == []
    assert {d.field for d in conversion.dropped} == {
        "clientConnection",
        "conntrack.maxPerCore",
        "logging",
    }
    # kube-proxy's own defaults (what it runs with that ConfigMap) convert to the same.
    written = convert(read_document(WRITTEN.read_text()))
    assert written.proxy_configuration == conversion.proxy_configuration
    assert written.lost == []


def test_every_kube_proxy_field_is_handled() -> None:
    """A configuration setting every field to something other than its zero value: each is
    carried into the spec or named, and nothing is silently skipped."""
    doc = yaml.safe_load(WRITTEN.read_text())
    assert set(doc) == TOP_FIELDS - {"featureGates", "windowsRunAsService"}
    for block, known in BLOCK_FIELDS.items():
        assert set(doc[block]) == known, block


@pytest.mark.parametrize("mode", ["iptables", "nftables", "ipvs"])
def test_mode_and_its_block_are_carried(mode: str) -> None:
    block = {
        "iptables": {
            "masqueradeBit": 3,
            "masqueradeAll": True,
            "localhostNodePorts": False,
            "syncPeriod": "1m0s",
            "minSyncPeriod": "2s",
        },
        "nftables": {
            "masqueradeBit": 5,
            "masqueradeAll": True,
            "syncPeriod": "45s",
            "minSyncPeriod": "0s",
        },
        "ipvs": {
            "scheduler": "wrr",
            "syncPeriod": "1m0s",
            "minSyncPeriod": "5s",
            "excludeCIDRs": ["10.0.0.0/8"],
            "strictARP": True,
            "tcpTimeout": "15m0s",
            "tcpFinTimeout": "2m0s",
            "udpTimeout": "5m0s",
        },
    }
    # upstream's ipvs mode takes masqueradeAll and masqueradeBit from its iptables block
    ipt = {"masqueradeBit": 7, "masqueradeAll": True} if mode == "ipvs" else {}
    spec = spec_of(mode=mode, **{mode: block[mode]}, **({"iptables": ipt} if ipt else {}))
    assert spec["mode"] == mode
    got = spec[mode]
    if mode == "iptables":
        assert got == {
            "masqueradeBit": 3,
            "masqueradeAll": True,
            "localhostNodePorts": False,
            "syncPeriod": "1m",
            "minSyncPeriod": "2s",
        }
    elif mode == "nftables":  # a 0s minSyncPeriod is kube-proxy's "default", 1s
        assert got == {
            "masqueradeBit": 5,
            "masqueradeAll": True,
            "localhostNodePorts": False,
            "syncPeriod": "45s",
            "minSyncPeriod": "1s",
        }
    else:
        assert got == {
            "acknowledgeDeprecation": True,
            "masqueradeBit": 7,
            "masqueradeAll": True,
            "scheduler": "wrr",
            "syncPeriod": "1m",
            "minSyncPeriod": "5s",
            "excludeCIDRs": ["10.0.0.0/8"],
            "strictARP": True,
            "tcpTimeout": "15m",
            "tcpFinTimeout": "2m",
            "udpTimeout": "5m",
        }
    assert [k for k in ("iptables", "nftables", "ipvs") if k in spec] == [mode]


def test_settings_of_other_modes_are_named_as_unused_by_kube_proxy_too() -> None:
    dropped = dropped_of(
        mode="nftables",
        iptables={"masqueradeAll": True, "masqueradeBit": 14},
        ipvs={"strictARP": True, "scheduler": ""},
    )
    assert dropped == {"iptables.masqueradeAll": False, "ipvs.strictARP": False}


def test_an_empty_mode_is_iptables_and_kernelspace_or_unknown_modes_are_refused() -> None:
    assert spec_of(mode="")["mode"] == "iptables"
    with pytest.raises(ConversionError, match="kernelspace is kube-proxy's Windows mode"):
        convert({**BASE, "mode": "kernelspace"})
    with pytest.raises(ConversionError, match="mode: 'userspace' is not a kube-proxy mode"):
        convert({**BASE, "mode": "userspace"})


def test_cluster_cidr_dual_stack_and_unmasked() -> None:
    assert spec_of(clusterCIDR="10.244.0.0/16,fd00:10:244::/56")["clusterCIDRs"] == [
        "10.244.0.0/16",
        "fd00:10:244::/56",
    ]
    assert spec_of(clusterCIDR="10.244.1.0/16")["clusterCIDRs"] == ["10.244.0.0/16"]
    assert dropped_of(clusterCIDR="10.244.1.0/16")["clusterCIDR"] is False
    with pytest.raises(ConversionError, match="clusterCIDR: 'x' is not a CIDR"):
        convert({**BASE, "clusterCIDR": "x"})
    with pytest.raises(ConversionError, match="clusterCIDRs"):  # two IPv4: kpx's own rule
        convert({**BASE, "clusterCIDR": "10.0.0.0/8,11.0.0.0/8"})


def test_node_port_addresses() -> None:
    assert spec_of(nodePortAddresses=["primary"])["nodePortAddresses"] == ["primary"]
    assert spec_of(nodePortAddresses=["192.168.0.0/24", "fd00::/64"])["nodePortAddresses"] == [
        "192.168.0.0/24",
        "fd00::/64",
    ]
    assert spec_of(nodePortAddresses=None)["nodePortAddresses"] == []


@pytest.mark.parametrize(
    ("fields", "healthz", "metrics"),
    [
        ({}, "0.0.0.0:10256", "127.0.0.1:10249"),
        ({"bindAddress": "::"}, "[::]:10256", "[::1]:10249"),
        (
            {"healthzBindAddress": "0.0.0.0:10266", "metricsBindAddress": "0.0.0.0:10249"},
            "0.0.0.0:10266",
            "0.0.0.0:10249",
        ),
        (
            {"healthzBindAddress": "10.0.0.1", "metricsBindAddress": "::1"},
            "10.0.0.1:10256",
            "[::1]:10249",
        ),
    ],
)
def test_bind_addresses(fields: dict[str, Any], healthz: str, metrics: str) -> None:
    spec = spec_of(**fields)
    assert (spec["healthzBindAddress"], spec["metricsBindAddress"]) == (healthz, metrics)


def test_a_specific_bind_address_and_hard_fail_are_named_as_lost() -> None:
    assert dropped_of(bindAddress="192.0.2.7")["bindAddress"] is True
    assert "bindAddress" not in dropped_of(bindAddress="0.0.0.0")
    assert dropped_of(bindAddressHardFail=True)["bindAddressHardFail"] is True
    assert "bindAddressHardFail" not in dropped_of(bindAddressHardFail=False)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"mode": "ClusterCIDR"}),
        ({"detectLocalMode": "NodeCIDR"}, {"mode": "NodeCIDR"}),
        (
            {"detectLocalMode": "BridgeInterface", "detectLocal": {"bridgeInterface": "cbr0"}},
            {"mode": "BridgeInterface", "bridgeInterface": "cbr0"},
        ),
        (
            {
                "detectLocalMode": "InterfaceNamePrefix",
                "detectLocal": {"interfaceNamePrefix": "veth"},
            },
            {"mode": "InterfaceNamePrefix", "interfaceNamePrefix": "veth"},
        ),
    ],
)
def test_detect_local(fields: dict[str, Any], expected: dict[str, str]) -> None:
    assert spec_of(**fields)["detectLocal"] == expected


def test_detect_local_settings_of_another_mode_are_named_and_a_missing_one_refused() -> None:
    dropped = dropped_of(detectLocalMode="NodeCIDR", detectLocal={"bridgeInterface": "cbr0"})
    assert dropped["detectLocal.bridgeInterface"] is False
    with pytest.raises(ConversionError, match="bridgeInterface is required"):
        convert({**BASE, "detectLocalMode": "BridgeInterface"})


def test_conntrack_nulls_are_kube_proxys_defaults_and_values_are_carried() -> None:
    ct = {
        "maxPerCore": 0,
        "min": 0,
        "tcpEstablishedTimeout": "0s",
        "tcpCloseWaitTimeout": "30m0s",
        "tcpBeLiberal": True,
        "udpTimeout": "30s",
        "udpStreamTimeout": "2m0s",
    }
    assert spec_of(conntrack=ct)["conntrack"] == {
        "maxPerCore": 0,
        "min": 0,
        "tcpEstablishedTimeout": "0s",
        "tcpCloseWaitTimeout": "30m",
        "tcpBeLiberal": True,
        "udpTimeout": "30s",
        "udpStreamTimeout": "2m",
    }
    # kind's kube-proxy: maxPerCore 0 (its nodes are containers: the table size is the host's)
    assert "conntrack.maxPerCore" not in dropped_of(conntrack={"maxPerCore": 0})
    assert dropped_of(conntrack={"maxPerCore": 1})["conntrack.maxPerCore"] is False


def test_feature_gates_are_named_as_lost() -> None:
    assert dropped_of(featureGates={"SomeGate": True}) == {"featureGates.SomeGate": True}


@pytest.mark.parametrize(
    "field",
    [
        "clientConnection",
        "logging",
        "hostnameOverride",
        "enableProfiling",
        "showHiddenMetricsForVersion",
        "oomScoreAdj",
        "configSyncPeriod",
        "portRange",
        "windowsRunAsService",
        "winkernel",
    ],
)
def test_process_plumbing_is_named_as_a_note(field: str) -> None:
    value: Any = {
        "clientConnection": {"kubeconfig": "/k", "qps": 5},
        "logging": {"verbosity": 2},
        "hostnameOverride": "n1",
        "enableProfiling": True,
        "showHiddenMetricsForVersion": "1.35",
        "oomScoreAdj": -999,
        "configSyncPeriod": "15m0s",
        "portRange": "30000-32767",
        "windowsRunAsService": True,
        "winkernel": {"networkName": "x"},
    }[field]
    assert dropped_of(**{field: value}) == {field: False}


def test_unknown_fields_and_bad_values_are_refused_naming_them() -> None:
    with pytest.raises(ConversionError, match=r"unknown field\(s\) typo, conntrack.maxPerCpu"):
        convert({**BASE, "typo": 1, "conntrack": {"maxPerCpu": 1}})
    with pytest.raises(
        ConversionError, match=re.escape("iptables.masqueradeBit: 'x' is not an integer")
    ):
        convert({**BASE, "iptables": {"masqueradeBit": "x"}})
    with pytest.raises(ConversionError, match="masqueradeBit"):  # kpx's range, 0-31
        convert({**BASE, "iptables": {"masqueradeBit": 40}})
    with pytest.raises(
        ConversionError, match=re.escape("nftables.syncPeriod: 'soon' is not a duration")
    ):
        convert({**BASE, "mode": "nftables", "nftables": {"syncPeriod": "soon"}})
    with pytest.raises(ConversionError, match=re.escape("ipvs.scheduler")):
        convert({**BASE, "mode": "ipvs", "ipvs": {"scheduler": "fifo"}})


def test_read_document_takes_a_configmap_or_the_bare_configuration() -> None:
    assert read_document(yaml.safe_dump(BASE)) == BASE
    with pytest.raises(ConversionError, match=re.escape("ConfigMap data has no config.conf")):
        read_document("kind: ConfigMap\ndata: {other: x}\n")
    with pytest.raises(ConversionError, match="expected a ConfigMap or kind"):
        read_document("kind: KubeletConfiguration\napiVersion: kubelet.config.k8s.io/v1beta1\n")


def test_cli_prints_the_resource_names_what_is_dropped_and_exits_by_what_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = "convert-kube-proxy-config"
    assert main([prog, str(KUBEADM), "--takeover", "--name", "kpx"]) == 0
    out, err = capsys.readouterr()
    pxc = yaml.safe_load(out)
    assert pxc["metadata"] == {"name": "kpx"}
    assert pxc["spec"]["takeover"] == {"fromKubeProxy": True, "moveKubeProxyOff": True}
    assert "note: clientConnection:" in err and "NOT CARRIED" not in err
    lossy = tmp_path / "lossy.yaml"
    lossy.write_text(yaml.safe_dump({**BASE, "bindAddressHardFail": True}))
    assert main([prog, str(lossy)]) == 1
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["kind"] == "ProxyConfiguration"
    assert "NOT CARRIED: bindAddressHardFail:" in err
    assert "1 field(s) in use not carried" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: ConfigMap\ndata: {}\n")
    assert main([prog, str(bad)]) == 2
    assert "ConfigMap data has no config.conf" in capsys.readouterr().err


def test_to_nftables_carries_the_shared_settings_and_names_what_only_iptables_does() -> None:
    doc = {
        **BASE,
        "iptables": {"masqueradeAll": True, "syncPeriod": "1m0s"},
        "conntrack": {"maxPerCore": 0},
    }
    conversion = convert(doc, to_nftables=True)
    spec = conversion.proxy_configuration["spec"]
    assert (spec["mode"], "iptables" in spec) == ("nftables", False)
    assert spec["nftables"] == {
        "masqueradeBit": 14,
        "masqueradeAll": True,
        "localhostNodePorts": False,  # the opt-in, written out as off
        "syncPeriod": "1m",
        "minSyncPeriod": "1s",
    }
    assert {d.field: d.lost for d in conversion.dropped} == {
        "iptables.localhostNodePorts": True,
        "nodePortAddresses": True,
    }
    (localhost,) = [d for d in conversion.dropped if d.field == "iptables.localhostNodePorts"]
    assert "set nftables.localhostNodePorts: true to keep them" in localhost.render()
    # Neither applies when NodePorts were on listed, non-loopback addresses only.
    listed = convert({**doc, "nodePortAddresses": ["192.168.0.0/24"]}, to_nftables=True)
    assert listed.dropped == []
    # kube-proxy already in mode nftables: nothing changes.
    same = convert({**BASE, "mode": "nftables"}, to_nftables=True)
    assert same.proxy_configuration == convert({**BASE, "mode": "nftables"}).proxy_configuration
    with pytest.raises(ConversionError, match="convert it as ipvs, then switch modes"):
        convert({**BASE, "mode": "ipvs"}, to_nftables=True)
