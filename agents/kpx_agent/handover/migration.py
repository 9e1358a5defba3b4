"""`proxy-agent explain-migration --from ipvs --to nftables`: what a switch would change.

Pure: from the ipvs settings and the cluster's Services (API objects as dicts) to a list of
findings, each naming what changes and for which Services. The CLI edge (cli.py) reads the
configuration file and lists the Services.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kpx_api.durations import parse_duration
from kpx_api.modes import IPVSScheduler, IPVSSettings


@dataclass(frozen=True)
class Finding:
    topic: str
    change: str
    services: tuple[str, ...] = field(default=())

    def render(self) -> str:
        text = f"- {self.topic}: {self.change}"
        if self.services:
            shown = ", ".join(self.services[:20])
            more = f" (and {len(self.services) - 20} more)" if len(self.services) > 20 else ""
            text += f"\n    Services: {shown}{more}"
        return text


def _name(svc: Mapping[str, Any]) -> str:
    meta = svc.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _proxied(services: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Services a proxy serves: not headless, not ExternalName."""
    out = []
    for svc in services:
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName" or spec.get("clusterIP") in (None, "", "None"):
            continue
        out.append(svc)
    return out


def explain(settings: IPVSSettings, services: Iterable[Mapping[str, Any]]) -> list[Finding]:
    """What moving from ipvs (with `settings`) to nftables changes for `services`."""
    proxied = _proxied(services)
    findings: list[Finding] = []
    scheduler = IPVSScheduler(settings.scheduler)
    if scheduler is not IPVSScheduler.RR:
        findings.append(
            Finding(
                "scheduler",
                f"ipvs balances with {scheduler.value}; nftables picks endpoints at random with "
                "equal probability (no least-connection, weights, hashing or locality)",
                tuple(_name(s) for s in proxied),
            )
        )
    timeouts = [
        (name, value)
        for name, value in (
            ("tcpTimeout", settings.tcp_timeout),
            ("tcpFinTimeout", settings.tcp_fin_timeout),
            ("udpTimeout", settings.udp_timeout),
        )
        if parse_duration(value) > 0
    ]
    if timeouts:
        listed = ", ".join(f"{n}={v}" for n, v in timeouts)
        findings.append(
            Finding(
                "timeouts",
                f"ipvs connection timeouts ({listed}) do not exist in nftables mode: connections "
                "follow conntrack's timeouts (spec.conntrack: tcpEstablishedTimeout, "
                "tcpCloseWaitTimeout, udpTimeout)",
            )
        )
    if settings.strict_arp:
        findings.append(
            Finding(
                "strictARP",
                "nftables mode binds no Service IP to an interface, so nodes do not answer ARP for "
                "them and strictARP has nothing to do; the arp_ignore/arp_announce values the ipvs "
                "agent set stay as they are until you change them",
            )
        )
    if settings.exclude_cidrs:
        findings.append(
            Finding(
                "excludeCIDRs",
                "nftables mode never touches IPVS: virtual servers in "
                f"{', '.join(settings.exclude_cidrs)} stay; the agent removes its own (kube-ipvs0, "
                "the kpx-ipvs table and every other virtual server) when it starts",
            )
        )
    affinity = [s for s in proxied if (s.get("spec") or {}).get("sessionAffinity") == "ClientIP"]
    if affinity:
        findings.append(
            Finding(
                "session affinity",
                "an ipvs persistence template expires timeoutSeconds after the client's last "
                "connection ends; in nftables mode the affinity expires timeoutSeconds after the "
                "client's last new connection (upstream's semantics)",
                tuple(_name(s) for s in affinity),
            )
        )
    local = [
        s
        for s in proxied
        if (s.get("spec") or {}).get("externalTrafficPolicy") == "Local"
        and (s.get("spec") or {}).get("type") in ("NodePort", "LoadBalancer")
    ]
    if local:
        findings.append(
            Finding(
                "externalTrafficPolicy Local",
                "pods and the node reaching these Services' external addresses are sent to any "
                "endpoint of the cluster in nftables mode (upstream's short circuit); in ipvs mode "
                "they get only this node's endpoints (or nothing)",
                tuple(_name(s) for s in local),
            )
        )
    node_ports = [
        s for s in proxied if (s.get("spec") or {}).get("type") in ("NodePort", "LoadBalancer")
    ]
    if node_ports:
        findings.append(
            Finding(
                "node addresses",
                "ipvs binds every Service IP to kube-ipvs0, so a node answers on them for any port "
                "(ports without a Service are refused by the node's own stack); nftables answers "
                "only on Service ports. NodePorts answer on nodePortAddresses (default: the node's "
                "primary addresses) in both modes",
                tuple(_name(s) for s in node_ports),
            )
        )
    findings.append(
        Finding(
            "switch",
            "change spec.mode to nftables (remove spec.ipvs): the new agents remove the IPVS "
            "virtual servers, kube-ipvs0 and the kpx-ipvs table at start; new connections are "
            "served by nftables at once, but connections open through a Service IP may break "
            "(IPVS, not conntrack, translated them): clients reconnect",
        )
    )
    return findings


def render(findings: list[Finding], total_services: int) -> str:
    head = (
        f"Moving from ipvs to nftables: {len(findings)} things change "
        f"({total_services} Services considered)."
    )
    return "\n".join([head, *(f.render() for f in findings)]) + "\n"
