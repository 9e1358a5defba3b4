"""Pure, shared by the agent and the operator: before a mode switch.

* The preflight report: which kpx modes a node can run, as its agent found (the agent's
  `preflight.py` checks). The agent writes the verdicts into its node's ProxyNodeState
  (status.preflight: what the operator reads), and records them for people as the message of
  an Event `ModePreflight` on its own Pod (`format_report`): one line per mode,
  `MODE: ok (DETAIL)` or `MODE: no (WHY)`.
* `dropped_settings`: what a switch from the agents' configuration in effect to another mode
  loses (settings with no counterpart in the new mode, or that the new spec does not carry
  over), each with the name the user puts in `spec.modeSwitch.acceptDropped` to let the switch
  proceed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kpx_api.durations import parse_duration
from kpx_api.modes import IPVSScheduler, IPVSSettings, Mode
from kpx_api.proxysettings import ProxySettings

#: The modes with kernel rules the agent checks (external has none: any node runs it).
CHECKED_MODES: Final = (Mode.NFTABLES, Mode.IPTABLES, Mode.IPVS)


@dataclass(frozen=True)
class ModeCheck:
    mode: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        verdict = "ok" if self.ok else "no"
        detail = self.detail.replace("\n", " ")[:280]
        return f"{self.mode}: {verdict} ({detail})" if detail else f"{self.mode}: {verdict}"


def format_report(checks: Iterable[ModeCheck]) -> str:
    return "\n".join(c.line() for c in checks)


class DroppedSetting(StrEnum):
    """A setting in effect that the new mode has no counterpart for."""

    IPVS_SCHEDULER = "ipvsScheduler"
    IPVS_TIMEOUTS = "ipvsTimeouts"
    LOCALHOST_NODE_PORTS = "localhostNodePorts"


@dataclass(frozen=True)
class Dropped:
    setting: DroppedSetting
    detail: str


def dropped_settings(current: ProxySettings, new: ProxySettings) -> list[Dropped]:
    """What switching from `current` (the agents' configuration in effect) to the spec `new`
    loses. Nothing when the mode does not change. Localhost NodePorts carry over to mode
    nftables when `new` has them in effect (nftables.localhostNodePorts: true, and
    nodePortAddresses allowing 127.0.0.1)."""
    old_mode, new_mode = str(current.mode), str(new.mode)
    if old_mode == new_mode:
        return []
    out: list[Dropped] = []
    block = current.mode_settings()
    if isinstance(block, IPVSSettings):
        scheduler = IPVSScheduler(block.scheduler)
        if scheduler is not IPVSScheduler.RR:
            out.append(
                Dropped(
                    DroppedSetting.IPVS_SCHEDULER,
                    f"ipvs.scheduler {scheduler.value}: mode {new_mode} picks "
                    "endpoints at random with equal probability",
                )
            )
        timeouts = [
            f"{name}={value}"
            for name, value in (
                ("tcpTimeout", block.tcp_timeout),
                ("tcpFinTimeout", block.tcp_fin_timeout),
                ("udpTimeout", block.udp_timeout),
            )
            if parse_duration(str(value)) > 0
        ]
        if timeouts:
            out.append(
                Dropped(
                    DroppedSetting.IPVS_TIMEOUTS,
                    f"ipvs {', '.join(timeouts)}: mode {new_mode} has no IPVS "
                    "timeouts; connections follow conntrack's "
                    "(spec.conntrack)",
                )
            )
    if current.localhost_node_ports_in_effect() and not new.localhost_node_ports_in_effect():
        out.append(Dropped(DroppedSetting.LOCALHOST_NODE_PORTS, _localhost_lost(old_mode, new)))
    return out


def _localhost_lost(old_mode: str, new: ProxySettings) -> str:
    lost = f"{old_mode}.localhostNodePorts: NodePorts stop answering on 127.0.0.1"
    if new.mode == Mode.NFTABLES:
        if getattr(new.mode_settings(), "localhost_node_ports", False):
            return f"{lost} (nodePortAddresses of the new spec leaves 127.0.0.1 out)"
        return f"{lost} (to carry them over, set nftables.localhostNodePorts: true)"
    return f"{lost} (mode {new.mode} has none, as upstream)"
