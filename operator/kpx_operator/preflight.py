"""Pure: condition Preflight, before (and during) a mode switch.

* `preflight_reports`: each node's verdicts per mode, from status.preflight of its node's
  ProxyNodeState as its *current* agent Pod wrote it (a state written by a Pod that is gone
  does not count; a node whose agent has not checked yet is not in it).
* `assess`: the nodes that cannot run spec.mode, and the settings in effect that the switch to
  spec.mode drops and spec.modeSwitch.acceptDropped does not accept (then the operator holds
  the switch: it does not apply the new spec).
* `condition`: Preflight's (status, reason, message), or None when there is nothing to say
  (no agent reported, no switch held).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kpx_api.preflight import Dropped, DroppedSetting, ModeCheck

from .admission import node_list
from .agent_reports import live_agents, node_states


def preflight_reports(
    pods: Iterable[Mapping[str, Any]], states: Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, ModeCheck]]:
    """node -> mode -> verdict, for each node whose current agent has checked; `states`: the
    ProxyNodeState objects."""
    live = live_agents(pods, scheduled_only=True)
    return {
        live[uid]: {str(v.mode): ModeCheck(str(v.mode), v.ok, v.detail) for v in s.preflight}
        for uid, s in node_states(states, live).items()
        if s.preflight
    }


@dataclass(frozen=True)
class Preflight:
    mode: str
    reported: int = 0  # nodes whose agent reported
    unable: tuple[tuple[str, str], ...] = ()  # (node, why) for nodes that cannot run mode
    held: tuple[Dropped, ...] = ()  # dropped and not accepted: the switch waits
    from_mode: str = ""


def assess(
    mode: str,
    reports: Mapping[str, Mapping[str, ModeCheck]],
    dropped: Iterable[Dropped] = (),
    accepted: Iterable[DroppedSetting] = (),
    from_mode: str = "",
) -> Preflight:
    unable = tuple(
        sorted(
            (node, checks[mode].detail)
            for node, checks in reports.items()
            if mode in checks and not checks[mode].ok
        )
    )
    ok = set(accepted)
    held = tuple(d for d in dropped if d.setting not in ok)
    return Preflight(mode, len(reports), unable, held, from_mode)


def condition(pf: Preflight) -> tuple[str, str, str] | None:
    """(status True/False, reason, message) of condition Preflight, or None."""
    unable = ""
    if pf.unable:
        nodes = node_list(n for n, _ in pf.unable)
        where = f"node {nodes}" if len(pf.unable) == 1 else f"nodes {nodes}"
        unable = f"mode {pf.mode} cannot run on {where}: {pf.unable[0][1]}"
    if pf.held:
        names = ", ".join(d.setting.value for d in pf.held)
        message = (
            f"the switch from mode {pf.from_mode} to {pf.mode} waits (the agents keep mode "
            f"{pf.from_mode}): it drops settings in effect: "
            + "; ".join(d.detail for d in pf.held)
            + f". To proceed, set spec.modeSwitch.acceptDropped: [{names}]"
        )
        return ("False", "SettingsNotCarriedOver", f"{message}. {unable}" if unable else message)
    if unable:
        return ("False", "NodesCannotRunMode", unable)
    if pf.reported:
        return (
            "True",
            "ModeCanRun",
            f"every node that reported ({pf.reported}) can run mode {pf.mode}",
        )
    return None
