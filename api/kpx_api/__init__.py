"""kpx_api: the ProxyConfiguration API (group proxy.kpx.dev, version v1alpha1).

Pydantic models are the single source of truth: the CRD (``python -m kpx_api.crdgen``), the
operator's validation and the agent's configuration file all come from them. No Kubernetes
client, no I/O besides reading and writing files.

The names below load their module on first use, so `import kpx_api.errors` (the agent)
does not build every model of the package first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kpx_api.agentconfig import (
        AgentConfiguration,
        agent_config_from_spec,
        dump_agent_config,
        load_agent_config,
        parse_agent_config,
    )
    from kpx_api.constants import API_VERSION, CRD_NAME, GROUP, KIND, PLURAL, VERSION
    from kpx_api.durations import Duration, format_duration, parse_duration
    from kpx_api.errors import ConfigError, FieldError
    from kpx_api.modes import (
        MODES_WITH_BACKEND,
        IPTablesSettings,
        IPVSScheduler,
        IPVSSettings,
        Mode,
        ModeSettings,
        NFTablesSettings,
        has_backend,
        no_backend_message,
    )
    from kpx_api.networks import ip_family, parse_bind_address, parse_cidr
    from kpx_api.proxyconfiguration import (
        Condition,
        ConditionStatus,
        ConditionType,
        ProxyConfiguration,
        ProxyConfigurationSpec,
        ProxyConfigurationStatus,
        parse_spec,
    )
    from kpx_api.proxysettings import (
        Conntrack,
        DetectLocal,
        DetectLocalMode,
        NamespaceOptOut,
        ProxySettings,
    )
    from kpx_api.scheduling import (
        ResourceRequirements,
        TaintEffect,
        Toleration,
        TolerationOperator,
        parse_quantity,
    )
    from kpx_api.selectors import LabelSelector, LabelSelectorRequirement, SelectorOperator

_EXPORTS = {
    "API_VERSION": "constants",
    "AgentConfiguration": "agentconfig",
    "CRD_NAME": "constants",
    "Condition": "proxyconfiguration",
    "ConditionStatus": "proxyconfiguration",
    "ConditionType": "proxyconfiguration",
    "ConfigError": "errors",
    "Conntrack": "proxysettings",
    "DetectLocal": "proxysettings",
    "DetectLocalMode": "proxysettings",
    "Duration": "durations",
    "FieldError": "errors",
    "GROUP": "constants",
    "IPTablesSettings": "modes",
    "IPVSScheduler": "modes",
    "IPVSSettings": "modes",
    "KIND": "constants",
    "LabelSelector": "selectors",
    "LabelSelectorRequirement": "selectors",
    "MODES_WITH_BACKEND": "modes",
    "Mode": "modes",
    "ModeSettings": "modes",
    "NFTablesSettings": "modes",
    "NamespaceOptOut": "proxysettings",
    "PLURAL": "constants",
    "ProxyConfiguration": "proxyconfiguration",
    "ProxyConfigurationSpec": "proxyconfiguration",
    "ProxyConfigurationStatus": "proxyconfiguration",
    "ProxySettings": "proxysettings",
    "ResourceRequirements": "scheduling",
    "SelectorOperator": "selectors",
    "TaintEffect": "scheduling",
    "Toleration": "scheduling",
    "TolerationOperator": "scheduling",
    "VERSION": "constants",
    "agent_config_from_spec": "agentconfig",
    "dump_agent_config": "agentconfig",
    "format_duration": "durations",
    "has_backend": "modes",
    "no_backend_message": "modes",
    "ip_family": "networks",
    "load_agent_config": "agentconfig",
    "parse_agent_config": "agentconfig",
    "parse_bind_address": "networks",
    "parse_cidr": "networks",
    "parse_duration": "durations",
    "parse_quantity": "scheduling",
    "parse_spec": "proxyconfiguration",
}
__all__ = [
    "API_VERSION",
    "CRD_NAME",
    "GROUP",
    "KIND",
    "MODES_WITH_BACKEND",
    "PLURAL",
    "VERSION",
    "AgentConfiguration",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "ConfigError",
    "Conntrack",
    "DetectLocal",
    "DetectLocalMode",
    "Duration",
    "FieldError",
    "IPTablesSettings",
    "IPVSScheduler",
    "IPVSSettings",
    "LabelSelector",
    "LabelSelectorRequirement",
    "Mode",
    "ModeSettings",
    "NFTablesSettings",
    "NamespaceOptOut",
    "ProxyConfiguration",
    "ProxyConfigurationSpec",
    "ProxyConfigurationStatus",
    "ProxySettings",
    "ResourceRequirements",
    "SelectorOperator",
    "TaintEffect",
    "Toleration",
    "TolerationOperator",
    "agent_config_from_spec",
    "dump_agent_config",
    "format_duration",
    "has_backend",
    "ip_family",
    "load_agent_config",
    "no_backend_message",
    "parse_agent_config",
    "parse_bind_address",
    "parse_cidr",
    "parse_duration",
    "parse_quantity",
    "parse_spec",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kpx_api' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kpx_api.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
