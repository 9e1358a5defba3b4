"""The agent's configuration file: the proxy settings of one ProxyConfiguration, as YAML.

The operator renders it (`agent_config_from_spec`, `dump_agent_config`) into the ConfigMap the
agents mount; the agent reads it with `load_agent_config`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, Self

import yaml
from pydantic import Field, ValidationError, model_validator

from kpx_api.constants import AGENT_CONFIG_KIND, API_VERSION
from kpx_api.errors import ConfigError, FieldError
from kpx_api.external import ExternalSettings
from kpx_api.modes import (
    ACKNOWLEDGE_IPVS_MESSAGE,
    KERNEL_BACKEND_MODES,
    SETTINGS_CLASS,
    IPTablesSettings,
    IPVSSettings,
    Mode,
    ModeSettings,
    NFTablesSettings,
)
from kpx_api.proxysettings import EXTERNAL_BLOCK_RULE, ProxySettings
from kpx_api.validation import KpxModel

if TYPE_CHECKING:  # the operator's side: the agent never builds the CRD's models
    from kpx_api.proxyconfiguration import ProxyConfigurationSpec


class Rollback(KpxModel):
    """While the operator switches spec.mode: the mode the switch comes from, which this
    agent's node goes back to when the agent has no verified first sync in its own mode within
    `progressDeadlineSeconds` (if `enabled`), and whose rules the agent's readiness waits to
    see removed (the operator renders it from spec.modeSwitch and the configuration in effect
    before the switch; docs/migrating.md)."""

    mode: Mode = Field(description="The mode to go back to (the one before the switch).")
    enabled: bool = Field(
        default=True,
        strict=True,
        description="Roll back (spec.modeSwitch.rollbackOnFailure); false: the agent keeps "
        "retrying its own mode, and the block only names the mode the switch comes from.",
    )
    nftables: NFTablesSettings | None = Field(default=None, description="Its settings.")
    iptables: IPTablesSettings | None = Field(default=None, description="Its settings.")
    ipvs: IPVSSettings | None = Field(default=None, description="Its settings.")
    progress_deadline_seconds: int = Field(
        ge=5,
        le=3600,
        strict=True,
        description="Seconds without a verified first sync in the agent's own mode after "
        "which it goes back to `mode`.",
    )

    @model_validator(mode="after")
    def _one_kernel_mode(self) -> Rollback:
        if self.mode not in KERNEL_BACKEND_MODES:
            raise ValueError(f"rollback.mode must be a kernel mode, not {self.mode}")
        others = [
            str(m)
            for m in KERNEL_BACKEND_MODES
            if m is not self.mode and getattr(self, str(m)) is not None
        ]
        if others:
            raise ValueError(
                f"rollback has settings of {', '.join(sorted(others))} but its mode is {self.mode}"
            )
        return self

    def mode_settings(self) -> ModeSettings:
        """The settings of `mode`: its block, or that block's defaults."""
        block: ModeSettings | None = getattr(self, str(self.mode))
        if block is None:
            block = SETTINGS_CLASS[self.mode]()  # type: ignore[call-arg]  # a kernel mode
        return block


class AgentConfiguration(ProxySettings):
    """Configuration of one node agent: the mode, the selected mode's settings and the shared
    settings (conntrack, clusterCIDRs, nodePortAddresses, detectLocal, bind addresses,
    namespaceOptOut)."""

    api_version: Literal["proxy.kpx.dev/v1alpha1"] = Field(
        default=API_VERSION, description="Always proxy.kpx.dev/v1alpha1."
    )
    kind: Literal["AgentConfiguration"] = Field(
        default=AGENT_CONFIG_KIND, description="Always AgentConfiguration."
    )

    # Mode external without an `external` block: the agent runs no backend container (the
    # operator does, from spec.external), so it needs no image; it reads only the block's sync
    # periods, whose defaults then apply (mode_settings).
    __rules__ = tuple(rule for rule in ProxySettings.__rules__ if rule is not EXTERNAL_BLOCK_RULE)

    rollback: Rollback | None = Field(
        default=None,
        description="Only while the operator switches spec.mode: the mode it comes from, where "
        "this agent goes back to if it cannot program its own (spec.modeSwitch).",
    )

    @classmethod
    def defaults_for(cls, mode: Mode | str, *, acknowledge_deprecation: bool = False) -> Self:
        """The default configuration of `mode`, with that mode's block filled in.

        Mode ipvs is deprecated upstream: it needs ``acknowledge_deprecation=True``, otherwise
        `ConfigError` is raised, as for a file without ``ipvs.acknowledgeDeprecation: true``.
        """
        selected = Mode(mode)
        if selected is Mode.EXTERNAL:
            # The agent serves the state API; the backend container is the operator's.
            return cls.model_validate({"mode": selected})
        block = SETTINGS_CLASS[selected]()  # type: ignore[call-arg]  # not external (above)
        if isinstance(block, IPVSSettings):
            if not acknowledge_deprecation:
                raise ConfigError(
                    "defaults",
                    [FieldError("ipvs.acknowledgeDeprecation", ACKNOWLEDGE_IPVS_MESSAGE)],
                )
            block = IPVSSettings(acknowledge_deprecation=True)
        return cls.model_validate({"mode": selected, str(selected): block})

    def mode_settings(self) -> ModeSettings:
        """The settings of the selected mode: its block, or that block's defaults (in mode
        external without a block: ExternalSettings' defaults without a backend image, which
        the agent never reads)."""
        if self.mode is Mode.EXTERNAL and self.external is None:
            return ExternalSettings.model_construct()  # type: ignore[call-arg]  # no image
        return super().mode_settings()

    def rollback_config(self) -> AgentConfiguration | None:
        """The configuration of the rollback mode (this one's shared settings, the rollback's
        mode and block, no rollback of its own); None without a rollback."""
        if self.rollback is None:
            return None
        values: dict[str, Any] = {name: getattr(self, name) for name in ProxySettings.model_fields}
        for mode in Mode:
            values[str(mode)] = None
        values["mode"] = self.rollback.mode
        values[str(self.rollback.mode)] = self.rollback.mode_settings()
        if isinstance(values[str(self.rollback.mode)], IPVSSettings):
            values["ipvs"] = values["ipvs"].model_copy(update={"acknowledge_deprecation": True})
        return AgentConfiguration.model_validate(values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, apiVersion and kind first."""
        data = super().to_dict()
        return {"apiVersion": data.pop("apiVersion"), "kind": data.pop("kind"), **data}


def agent_config_from_spec(
    spec: ProxyConfigurationSpec, rollback: Rollback | None = None
) -> AgentConfiguration:
    """The agents' configuration for a ProxyConfiguration spec (and, during a switch of
    mode, where to go back to).

    Copies the shared settings and the selected mode's block, filled with its defaults when
    the spec leaves it out, so the file states every value the agent uses.
    """
    values: dict[str, Any] = {name: getattr(spec, name) for name in ProxySettings.model_fields}
    values[str(spec.mode)] = spec.mode_settings()
    values["rollback"] = rollback
    return AgentConfiguration.model_validate(values)


def dump_agent_config(config: AgentConfiguration) -> str:
    """The configuration as YAML (the ConfigMap's content)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)


def parse_agent_config(data: Any, source: str = "agent configuration") -> AgentConfiguration:
    """Validate already-parsed YAML; `ConfigError` names every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(source, [FieldError("", "must be a mapping (apiVersion, kind, mode...)")])
    try:
        return AgentConfiguration.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source) from None


def load_agent_config(path: str | os.PathLike[str]) -> AgentConfiguration:
    """Read and validate the agent's configuration file.

    Raises `ConfigError` (one line per problem, each naming the file and the field) when the
    file cannot be read, is not YAML, or does not validate.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(source, [FieldError("", f"cannot read: {exc.strerror}")]) from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(source, [FieldError("", f"not valid YAML: {detail}")]) from None
    return parse_agent_config(data, source)


def parse_agent_config_text(text: str, source: str = "agent configuration") -> AgentConfiguration:
    """`dump_agent_config`'s inverse (the ConfigMap's content); raises `ConfigError`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(source, [FieldError("", f"not valid YAML: {detail}")]) from None
    return parse_agent_config(data, source)
