"""From the validated configuration file (kpx_api models) to what the agent runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kpx_api.agentconfig import AgentConfiguration, load_agent_config, parse_agent_config
from kpx_api.durations import parse_duration
from kpx_api.modes import IPVSSettings, state_server_only
from kpx_api.networks import parse_bind_address, parse_cidr
from kpx_api.proxysettings import Conntrack, NamespaceOptOut

from .model.types import DataplaneSettings, DetectLocal, DetectLocalMode, IPVSOptions


@dataclass(frozen=True)
class AgentSettings:
    mode: str
    sync_period: float
    min_sync_period: float
    proxy: DataplaneSettings
    optout: NamespaceOptOut
    healthz: tuple[str, int]
    metrics: tuple[str, int]
    #: The node's conntrack sysctls (conntrack/sysctl.py).
    conntrack: Conntrack = field(default_factory=Conntrack)
    #: Where the node-local state API listens (stateAPI.address), None when it is off.
    state_api: str | None = None
    #: spec.takeover.fromKubeProxy: remove upstream kube-proxy's rules
    #: (handover/from_kube_proxy.py).
    takeover_from_kube_proxy: bool = False
    #: While the operator switches modes: where to go back to (rollback.py), else None.
    rollback: RollbackSettings | None = None


@dataclass(frozen=True)
class RollbackSettings:
    """The configuration's `rollback`: the mode to go back to, resolved as a whole
    configuration of its own (the shared settings, its mode block), and the deadline (s)."""

    settings: AgentSettings
    deadline: float
    #: Roll back; False: only the mode the switch comes from (readiness waits for its
    #: rules' removal).
    enabled: bool = True


def _detect_local(config: AgentConfiguration) -> DetectLocal:
    spec = config.detect_local
    mode = DetectLocalMode(str(spec.mode))
    interface = spec.bridge_interface or spec.interface_name_prefix or ""
    return DetectLocal(mode, interface)


def _ipvs_options(config: AgentConfiguration) -> IPVSOptions:
    block = config.mode_settings()
    if not isinstance(block, IPVSSettings):
        return IPVSOptions()
    return IPVSOptions(
        scheduler=str(block.scheduler),
        strict_arp=block.strict_arp,
        exclude_cidrs=tuple(parse_cidr(c) for c in block.exclude_cidrs),
        tcp_timeout=int(parse_duration(block.tcp_timeout)),
        tcp_fin_timeout=int(parse_duration(block.tcp_fin_timeout)),
        udp_timeout=int(parse_duration(block.udp_timeout)),
    )


def resolve(config: AgentConfiguration) -> AgentSettings:
    block = config.mode_settings()
    nodeport = tuple(parse_cidr(a) for a in config.node_port_addresses if a != "primary")
    localhost_node_ports = config.localhost_node_ports_in_effect()
    return AgentSettings(
        mode=str(config.mode),
        sync_period=parse_duration(block.sync_period),
        min_sync_period=parse_duration(block.min_sync_period),
        proxy=DataplaneSettings(
            masquerade_bit=getattr(block, "masquerade_bit", 14),
            masquerade_all=getattr(block, "masquerade_all", False),
            cluster_cidrs=tuple(parse_cidr(c) for c in config.cluster_cidrs),
            node_port_networks=nodeport,
            detect_local=_detect_local(config),
            localhost_node_ports=localhost_node_ports,
            conntrack_tcp_be_liberal=config.conntrack.tcp_be_liberal,
            ipvs=_ipvs_options(config),
            external_ip_networks=tuple(parse_cidr(c) for c in config.external_ips.allowed_cidrs),
        ),
        optout=config.namespace_opt_out,
        healthz=parse_bind_address(config.healthz_bind_address),
        metrics=parse_bind_address(config.metrics_bind_address),
        conntrack=config.conntrack,
        state_api=(
            config.state_api.address
            if config.state_api.enabled or state_server_only(str(config.mode))
            else None
        ),
        takeover_from_kube_proxy=config.takeover.from_kube_proxy,
        rollback=_rollback(config),
    )


def _rollback(config: AgentConfiguration) -> RollbackSettings | None:
    fallback = config.rollback_config()
    if fallback is None or config.rollback is None:
        return None
    return RollbackSettings(
        resolve(fallback),
        float(config.rollback.progress_deadline_seconds),
        config.rollback.enabled,
    )


def load(
    mode: str,
    path: Path | None,
    overrides: dict[str, Any] | None = None,
) -> AgentConfiguration:
    """The configuration from `path` (or `mode`'s defaults), with command-line `overrides`
    (camelCase field names) applied and validated by the same models.

    Raises kpx_api.errors.ConfigError naming each bad field.
    """
    if path is not None:
        config = load_agent_config(path)
    else:
        config = AgentConfiguration.defaults_for(mode, acknowledge_deprecation=True)
    if overrides:
        config = parse_agent_config({**config.to_dict(), **overrides}, source="command-line flags")
    return config
