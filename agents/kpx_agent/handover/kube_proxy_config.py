"""Pure: upstream kube-proxy's configuration (KubeProxyConfiguration, kubeproxy.config.k8s.io/
v1alpha1, as in kubeadm's kube-system/kube-proxy ConfigMap, key config.conf) into a
ProxyConfiguration, naming every field that is not carried and why.

kube-proxy's zero values mean "its default" (an empty mode is iptables, a 0s syncPeriod is 30s,
a null conntrack.maxPerCore is 32768, ...): they are resolved first, as kube-proxy v1.36 does
(pkg/proxy/apis/config/v1alpha1/defaults.go), so the result says explicitly what kube-proxy ran.
Each field that is not carried is a `Dropped`: `lost` when it is in use and kpx does not do what
it asked (a person must decide: the CLI exits non-zero), else a note (kube-proxy plumbing that kpx
does its own way, or a value kube-proxy itself ignores in that mode).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import yaml
from pydantic import ValidationError

from kpx_api import ProxyConfiguration
from kpx_api.durations import parse_duration
from kpx_api.errors import ConfigError

API_VERSION: Final = "kubeproxy.config.k8s.io/v1alpha1"
KIND: Final = "KubeProxyConfiguration"
#: The key kubeadm writes the configuration under in the kube-system/kube-proxy ConfigMap.
CONFIGMAP_KEY: Final = "config.conf"

HEALTHZ_PORT: Final = 10256
METRICS_PORT: Final = 10249

#: Every field of v1alpha1 KubeProxyConfiguration (k8s.io/kube-proxy v0.36), by block.
TOP_FIELDS: Final = frozenset(
    {
        "apiVersion",
        "kind",
        "featureGates",
        "clientConnection",
        "logging",
        "hostnameOverride",
        "bindAddress",
        "healthzBindAddress",
        "metricsBindAddress",
        "bindAddressHardFail",
        "enableProfiling",
        "showHiddenMetricsForVersion",
        "mode",
        "iptables",
        "ipvs",
        "nftables",
        "winkernel",
        "detectLocalMode",
        "detectLocal",
        "clusterCIDR",
        "nodePortAddresses",
        "oomScoreAdj",
        "conntrack",
        "configSyncPeriod",
        "portRange",
        "windowsRunAsService",
    }
)
BLOCK_FIELDS: Final[dict[str, frozenset[str]]] = {
    "iptables": frozenset(
        {"masqueradeBit", "masqueradeAll", "localhostNodePorts", "syncPeriod", "minSyncPeriod"}
    ),
    "ipvs": frozenset(
        {
            "syncPeriod",
            "minSyncPeriod",
            "scheduler",
            "excludeCIDRs",
            "strictARP",
            "tcpTimeout",
            "tcpFinTimeout",
            "udpTimeout",
        }
    ),
    "nftables": frozenset({"masqueradeBit", "masqueradeAll", "syncPeriod", "minSyncPeriod"}),
    "conntrack": frozenset(
        {
            "maxPerCore",
            "min",
            "tcpEstablishedTimeout",
            "tcpCloseWaitTimeout",
            "tcpBeLiberal",
            "udpTimeout",
            "udpStreamTimeout",
        }
    ),
    "detectLocal": frozenset({"bridgeInterface", "interfaceNamePrefix"}),
    "winkernel": frozenset(
        {"networkName", "sourceVip", "enableDSR", "rootHnsEndpointName", "forwardHealthCheckVip"}
    ),
}

#: kubeadm's kube-proxy DaemonSet (cmd/kubeadm/app/phases/addons/proxy/manifests.go) runs on
#: every Linux node, whatever its taints: the agents go where kube-proxy went.
KUBEADM_PLACEMENT: Final[dict[str, Any]] = {
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"operator": "Exists"}],
}

_PLUMBING: Final[dict[str, str]] = {
    "clientConnection": "the agents reach the apiserver with their own ServiceAccount token "
    "(the operator's --apiserver-endpoint or the default/kubernetes EndpointSlice), not a "
    "kubeconfig file",
    "logging": "the agents' logging is set by their own command line (-v), not by this block",
    "hostnameOverride": "each agent takes its node's name from its Pod's spec.nodeName",
    "enableProfiling": "the agents serve no /debug/pprof",
    "showHiddenMetricsForVersion": "the agents hide no metrics",
    "oomScoreAdj": "the kubelet sets the agents' oom_score_adj from their QoS class; their "
    "Pods have priorityClassName system-node-critical",
    "configSyncPeriod": "the agents list and watch Services, EndpointSlices and their Node "
    "with no informer resync period to set; each mode's syncPeriod re-checks the rules",
    "portRange": "kube-proxy ignores it since the userspace mode was removed",
    "windowsRunAsService": "Windows only",
    "winkernel": "Windows only (mode kernelspace)",
}


class ConversionError(ValueError):
    """The input is not a KubeProxyConfiguration that can be read; names the field."""


@dataclass(frozen=True, order=True)
class Dropped:
    """A field that the ProxyConfiguration does not carry."""

    field: str
    reason: str
    #: In use, and kpx does not do what it asked: the result needs a person's review.
    lost: bool = False

    def render(self) -> str:
        kind = "NOT CARRIED" if self.lost else "note"
        return f"{kind}: {self.field}: {self.reason}"


@dataclass
class Conversion:
    """The ProxyConfiguration (as a dict, validated) and what it does not carry."""

    proxy_configuration: dict[str, Any]
    dropped: list[Dropped] = field(default_factory=list)

    @property
    def lost(self) -> list[Dropped]:
        return [d for d in self.dropped if d.lost]


# -- reading the input -----------------------------------------------------------------------------


def read_document(text: str) -> dict[str, Any]:
    """The KubeProxyConfiguration in `text`: a kube-system/kube-proxy ConfigMap (its
    config.conf, as `kubectl get configmap -o yaml` prints it) or the bare configuration."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConversionError(f"not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ConversionError("expected a ConfigMap or a KubeProxyConfiguration object")
    if doc.get("kind") == "ConfigMap":
        data = doc.get("data") or {}
        if CONFIGMAP_KEY not in data:
            keys = ", ".join(sorted(data)) or "none"
            raise ConversionError(f"ConfigMap data has no {CONFIGMAP_KEY} (keys: {keys})")
        return read_document(str(data[CONFIGMAP_KEY]))
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise ConversionError(
            f"kind {doc.get('kind')!r}, apiVersion {doc.get('apiVersion')!r}: expected a "
            f"ConfigMap or kind {KIND}, apiVersion {API_VERSION}"
        )
    return doc


def _check_known(doc: Mapping[str, Any]) -> None:
    """kube-proxy decodes strictly: an unknown field is an error there, and here."""
    unknown = sorted(set(doc) - TOP_FIELDS)
    for block, known in BLOCK_FIELDS.items():
        value = doc.get(block)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ConversionError(f"{block}: must be an object")
        unknown += sorted(f"{block}.{k}" for k in set(value) - known)
    if unknown:
        raise ConversionError(f"unknown field(s) {', '.join(unknown)} (kube-proxy refuses them)")


# -- kube-proxy's defaults ---------------------------------------------------------------------


def _seconds(value: Any, where: str) -> float:
    if value is None or value == "":
        return 0.0
    try:
        return parse_duration(str(value))
    except ValueError:
        raise ConversionError(
            f"{where}: {value!r} is not a duration such as 30s or 1h0m0s"
        ) from None


def _duration(seconds: float) -> str:
    """A duration as the CRD writes it: whole hours, minutes or seconds when exact."""
    if seconds and seconds == int(seconds):
        whole = int(seconds)
        for unit, size in (("h", 3600), ("m", 60)):
            if whole % size == 0:
                return f"{whole // size}{unit}"
        return f"{whole}s"
    return f"{seconds:g}s" if seconds else "0s"


def _period(block: Mapping[str, Any], name: str, default: float, where: str) -> str:
    seconds = _seconds(block.get(name), f"{where}.{name}")
    return _duration(seconds if seconds > 0 else default)


def _int(value: Any, where: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConversionError(f"{where}: {value!r} is not an integer")
    return value


def _bool(value: Any, where: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConversionError(f"{where}: {value!r} is not true or false")
    return value


def _cidr(text: str, where: str, dropped: list[Dropped]) -> str:
    try:
        network = ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ConversionError(f"{where}: {text!r} is not a CIDR") from None
    if str(network) != text.strip():
        reason = (
            f"{text!r} has bits set after the prefix length: written as its network "
            f"{network}, which is what kube-proxy matches"
        )
        dropped.append(Dropped(where, reason))
    return str(network)


def _bind(value: Any, port: int, unspecified_default: str, where: str) -> str:
    """kube-proxy's healthz/metrics address: empty -> the default for bindAddress' family;
    an address without a port gets the default port (proxyutil.AppendPortIfNeeded)."""
    text = str(value or "")
    if not text:
        return f"{unspecified_default}:{port}"
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return text  # IP:port (checked by the ProxyConfiguration's own validation)
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


# -- the conversion --------------------------------------------------------------------------------


def _mode_block(doc: Mapping[str, Any], mode: str, dropped: list[Dropped]) -> dict[str, Any]:
    ipt = doc.get("iptables") or {}
    if mode == "nftables":
        nft = doc.get("nftables") or {}
        return {
            "masqueradeBit": _int(nft.get("masqueradeBit"), "nftables.masqueradeBit", 14),
            "masqueradeAll": _bool(nft.get("masqueradeAll"), "nftables.masqueradeAll"),
            # kube-proxy's nftables mode has none; kpx's opt-in, written out as off.
            "localhostNodePorts": False,
            "syncPeriod": _period(nft, "syncPeriod", 30, "nftables"),
            "minSyncPeriod": _period(nft, "minSyncPeriod", 1, "nftables"),
        }
    if mode == "iptables":
        return {
            "masqueradeBit": _int(ipt.get("masqueradeBit"), "iptables.masqueradeBit", 14),
            "masqueradeAll": _bool(ipt.get("masqueradeAll"), "iptables.masqueradeAll"),
            "localhostNodePorts": _bool(
                ipt.get("localhostNodePorts"), "iptables.localhostNodePorts", True
            ),
            "syncPeriod": _period(ipt, "syncPeriod", 30, "iptables"),
            "minSyncPeriod": _period(ipt, "minSyncPeriod", 1, "iptables"),
        }
    ipvs = doc.get("ipvs") or {}
    dropped.append(
        Dropped(
            "mode",
            "ipvs is deprecated upstream: the ProxyConfiguration sets "
            "ipvs.acknowledgeDeprecation: true to keep it; mode nftables is "
            "recommended (`proxy-agent explain-migration --from ipvs --to "
            "nftables` lists what a switch changes)",
        )
    )
    excluded = ipvs.get("excludeCIDRs") or []
    if not isinstance(excluded, list):
        raise ConversionError("ipvs.excludeCIDRs: must be a list of CIDRs")
    return {
        "acknowledgeDeprecation": True,
        # Upstream's ipvs mode reads both from its iptables block.
        "masqueradeBit": _int(ipt.get("masqueradeBit"), "iptables.masqueradeBit", 14),
        "masqueradeAll": _bool(ipt.get("masqueradeAll"), "iptables.masqueradeAll"),
        "scheduler": str(ipvs.get("scheduler") or "rr"),
        "syncPeriod": _period(ipvs, "syncPeriod", 30, "ipvs"),
        "minSyncPeriod": _duration(_seconds(ipvs.get("minSyncPeriod"), "ipvs.minSyncPeriod")),
        "strictARP": _bool(ipvs.get("strictARP"), "ipvs.strictARP"),
        "excludeCIDRs": [
            _cidr(str(c), f"ipvs.excludeCIDRs[{i}]", dropped) for i, c in enumerate(excluded)
        ],
        **{
            name: _duration(_seconds(ipvs.get(name), f"ipvs.{name}"))
            for name in ("tcpTimeout", "tcpFinTimeout", "udpTimeout")
        },
    }


def _unused_blocks(doc: Mapping[str, Any], mode: str, dropped: list[Dropped]) -> None:
    """Settings of other modes' blocks, set to something: kube-proxy ignores them too."""
    used = {
        "iptables": {"iptables"},
        "nftables": {"nftables"},
        "ipvs": {"ipvs", "iptables.masqueradeBit", "iptables.masqueradeAll"},
    }[mode]
    defaults = {"masqueradeBit": 14, "localhostNodePorts": True, "scheduler": ""}
    for block in ("iptables", "ipvs", "nftables"):
        if block in used:
            continue
        for name, value in sorted((doc.get(block) or {}).items()):
            where = f"{block}.{name}"
            if where in used or value in (None, "", False, [], "0s", 0, defaults.get(name)):
                continue
            dropped.append(
                Dropped(
                    where, f"set to {value!r}, but kube-proxy does not use it in mode {mode} either"
                )
            )


def _detect_local(doc: Mapping[str, Any], dropped: list[Dropped]) -> dict[str, Any]:
    mode = str(doc.get("detectLocalMode") or "ClusterCIDR")
    block = doc.get("detectLocal") or {}
    out: dict[str, Any] = {"mode": mode}
    wanted = {"BridgeInterface": "bridgeInterface", "InterfaceNamePrefix": "interfaceNamePrefix"}
    for name in ("bridgeInterface", "interfaceNamePrefix"):
        value = block.get(name)
        if not value:
            continue
        if wanted.get(mode) == name:
            out[name] = str(value)
        else:
            dropped.append(
                Dropped(
                    f"detectLocal.{name}",
                    f"set to {value!r}, but only used "
                    f"with detectLocalMode {name[0].upper()}{name[1:]} (kube-proxy "
                    f"ignores it with {mode})",
                )
            )
    return out


def _conntrack(doc: Mapping[str, Any]) -> dict[str, Any]:
    ct = doc.get("conntrack") or {}
    established = ct.get("tcpEstablishedTimeout")
    close_wait = ct.get("tcpCloseWaitTimeout")
    return {
        "maxPerCore": _int(ct.get("maxPerCore"), "conntrack.maxPerCore", 32768),
        "min": _int(ct.get("min"), "conntrack.min", 131072),
        # null: kube-proxy's default; an explicit 0s: leave the kernel's value (as here).
        "tcpEstablishedTimeout": "24h"
        if established is None
        else _duration(_seconds(established, "conntrack.tcpEstablishedTimeout")),
        "tcpCloseWaitTimeout": "1h"
        if close_wait is None
        else _duration(_seconds(close_wait, "conntrack.tcpCloseWaitTimeout")),
        "tcpBeLiberal": _bool(ct.get("tcpBeLiberal"), "conntrack.tcpBeLiberal"),
        "udpTimeout": _duration(_seconds(ct.get("udpTimeout"), "conntrack.udpTimeout")),
        "udpStreamTimeout": _duration(
            _seconds(ct.get("udpStreamTimeout"), "conntrack.udpStreamTimeout")
        ),
    }


def _bind_address(doc: Mapping[str, Any], dropped: list[Dropped]) -> str:
    """bindAddress' family picks the default healthz and metrics addresses; any address other
    than an unspecified one also overrides kube-proxy's idea of the node's primary IP."""
    text = str(doc.get("bindAddress") or "0.0.0.0")  # noqa: S104 - kube-proxy's default
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ConversionError(f"bindAddress: {text!r} is not an IP address") from None
    if not address.is_unspecified:
        dropped.append(
            Dropped(
                "bindAddress",
                f"{text} overrides kube-proxy's idea of the "
                "node's primary IP; the agents take the node's primary IPs from "
                "its Node object (status.addresses)",
                lost=True,
            )
        )
    return "v6" if address.version == 6 else "v4"


def _plumbing(doc: Mapping[str, Any], dropped: list[Dropped]) -> None:
    for name, reason in _PLUMBING.items():
        value = doc.get(name)
        if value in (None, "", "0s", 0, False, {}, []) or (
            isinstance(value, Mapping)
            and not any(v not in (None, "", False, 0, "0s") for v in value.values())
        ):
            continue
        dropped.append(Dropped(name, reason))
    if str(doc.get("mode") or "") == "kernelspace":
        raise ConversionError("mode: kernelspace is kube-proxy's Windows mode; kpx runs on Linux")


def _to_nftables(spec: dict[str, Any], source: str, dropped: list[Dropped]) -> None:
    """Mode nftables in place of kube-proxy's iptables mode (`to_nftables`): the settings both
    modes have move to the nftables block; what only iptables does is named as lost."""
    block = spec.pop(source)
    if block.pop("localhostNodePorts") and (
        not spec["nodePortAddresses"]
        or any(
            a != "primary" and ipaddress.ip_address("127.0.0.1") in ipaddress.ip_network(a)
            for a in spec["nodePortAddresses"]
        )
    ):
        dropped.append(
            Dropped(
                "iptables.localhostNodePorts",
                "true (kube-proxy's default): "
                "its iptables mode answers NodePorts on 127.0.0.1; mode nftables "
                "does not by default (as upstream's nftables mode): set "
                "nftables.localhostNodePorts: true to keep them (kpx's opt-in, "
                "docs/api.md)",
                lost=True,
            )
        )
    if not spec["nodePortAddresses"]:
        dropped.append(
            Dropped(
                "nodePortAddresses",
                "empty: in kube-proxy's iptables mode "
                "NodePorts answer on every local IP of the node; in mode nftables "
                "on its primary IPs only (as upstream's nftables mode): CIDRs in "
                "nodePortAddresses choose other addresses",
                lost=True,
            )
        )
    spec["mode"] = "nftables"
    # localhostNodePorts written out as off: kpx's opt-in that would keep them (named above).
    spec["nftables"] = {
        "masqueradeBit": block["masqueradeBit"],
        "masqueradeAll": block["masqueradeAll"],
        "localhostNodePorts": False,
        "syncPeriod": block["syncPeriod"],
        "minSyncPeriod": block["minSyncPeriod"],
    }


def convert(
    doc: Mapping[str, Any],
    name: str = "default",
    takeover: bool = False,
    to_nftables: bool = False,
) -> Conversion:
    """The ProxyConfiguration doing what the KubeProxyConfiguration `doc` did, and what it
    does not carry; with `to_nftables`, in mode nftables where kube-proxy ran iptables.
    ConversionError names a field that cannot be read; the result is validated against the
    ProxyConfiguration models (ConversionError if it does not)."""
    _check_known(doc)
    dropped: list[Dropped] = []
    _plumbing(doc, dropped)
    mode = str(doc.get("mode") or "iptables")
    if mode not in ("iptables", "nftables", "ipvs"):
        raise ConversionError(f"mode: {mode!r} is not a kube-proxy mode (iptables, ipvs, nftables)")
    family = _bind_address(doc, dropped)
    # The unspecified address is kube-proxy's own healthz default, not a choice made here.
    any_v4, any_v6 = "0.0.0.0", "[::]"  # noqa: S104
    healthz_default, metrics_default = (
        (any_v4, "127.0.0.1") if family == "v4" else (any_v6, "[::1]")
    )

    spec: dict[str, Any] = {"mode": mode, mode: _mode_block(doc, mode, dropped)}
    _unused_blocks(doc, mode, dropped)
    cidrs = [c for c in str(doc.get("clusterCIDR") or "").split(",") if c.strip()]
    spec["clusterCIDRs"] = [_cidr(c, "clusterCIDR", dropped) for c in cidrs]
    addresses = doc.get("nodePortAddresses") or []
    if not isinstance(addresses, list):
        raise ConversionError("nodePortAddresses: must be a list")
    spec["nodePortAddresses"] = [
        a if a == "primary" else _cidr(str(a), f"nodePortAddresses[{i}]", dropped)
        for i, a in enumerate(addresses)
    ]
    if to_nftables and mode == "ipvs":
        raise ConversionError(
            "mode ipvs cannot be converted to mode nftables in one step: convert it as ipvs, "
            "then switch modes (`proxy-agent explain-migration --from ipvs --to nftables`, "
            "docs/migrating.md)"
        )
    if to_nftables and mode == "iptables":
        _to_nftables(spec, mode, dropped)
    spec["detectLocal"] = _detect_local(doc, dropped)
    spec["conntrack"] = _conntrack(doc)
    if spec["conntrack"]["maxPerCore"] > 0:
        dropped.append(
            Dropped(
                "conntrack.maxPerCore",
                "carried; the agents only ever raise "
                "nf_conntrack_max (kube-proxy also lowers a larger value), and "
                "where it is global and read-only (a node that is a container, "
                "as kind's) they report it not applied: maxPerCore 0 leaves it "
                "alone",
            )
        )
    spec["healthzBindAddress"] = _bind(
        doc.get("healthzBindAddress"), HEALTHZ_PORT, healthz_default, "healthzBindAddress"
    )
    spec["metricsBindAddress"] = _bind(
        doc.get("metricsBindAddress"), METRICS_PORT, metrics_default, "metricsBindAddress"
    )
    if _bool(doc.get("bindAddressHardFail"), "bindAddressHardFail"):
        dropped.append(
            Dropped(
                "bindAddressHardFail",
                "kube-proxy exits when it cannot bind its "
                "healthz or metrics port; an agent keeps retrying the bind (its "
                "health port stays unserved meanwhile) and does not exit",
                lost=True,
            )
        )
    for gate, value in sorted((doc.get("featureGates") or {}).items()):
        dropped.append(
            Dropped(
                f"featureGates.{gate}",
                f"set to {value}: the agents have no "
                "feature gates (they behave as kube-proxy v1.36 with its default "
                "gates); check that the behaviour this gate changes is not "
                "needed",
                lost=True,
            )
        )
    spec.update(KUBEADM_PLACEMENT)
    if takeover:
        spec["takeover"] = {"fromKubeProxy": True, "moveKubeProxyOff": True}
    pxc = {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": name},
        "spec": spec,
    }
    try:
        ProxyConfiguration.model_validate(pxc)
    except ValidationError as exc:
        error = ConfigError.from_validation_error(exc, "ProxyConfiguration")
        raise ConversionError(str(error)) from None
    return Conversion(pxc, sorted(dropped))


def render(conversion: Conversion, source: str) -> str:
    """The ProxyConfiguration as YAML, headed by where it came from."""
    head = (
        f"# Converted from kube-proxy's configuration ({source}) by proxy-agent "
        "convert-kube-proxy-config.\n"
    )
    return head + yaml.safe_dump(conversion.proxy_configuration, sort_keys=False)
