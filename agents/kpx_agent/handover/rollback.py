"""Pure: when an agent whose mode cannot program its node goes back to the mode before a switch.

While the operator switches spec.mode, the agents' configuration carries a `rollback` block:
the mode before the switch, its settings, and `progressDeadlineSeconds`. An agent that has
run that long without a verified first sync in its own mode (its rules programmed and found
in the kernel) rolls its node back, in process (`Agent.roll_back`): it stops programming
its own mode, programs the old mode (whose rules it never removed: make-before-break) from
then on with live updates, removes what its own mode left, and stays not Ready (/readyz 503,
the reason in the body) so the DaemonSet's rolling update stops at that node. It stays so
until its Pod is replaced: a node that could not run the mode once is not retried by itself.
"""

from __future__ import annotations

from ..settings import RollbackSettings

#: How much of the kernel's error the RolledBack Event carries (the operator's status message
#: adds what to do, within 1024 characters).
ERROR_LIMIT = 400


def rollback_due(
    rollback: RollbackSettings | None, verified: bool, rolled_back: bool, running_for: float
) -> bool:
    """Whether the agent goes back now: a rollback is configured and enabled, it is not back
    already, its first sync is not verified, and it has run (s) at least the deadline."""
    return seconds_left(rollback, verified, rolled_back, running_for) == 0.0


def seconds_left(
    rollback: RollbackSettings | None, verified: bool, rolled_back: bool, running_for: float
) -> float | None:
    """How long until `rollback_due` turns true (None: it will not, as things stand)."""
    if rollback is None or not rollback.enabled or verified or rolled_back:
        return None
    return max(0.0, rollback.deadline - running_for)


def rolled_back_message(mode: str, deadline: float, error: str, to: str) -> str:
    """The RolledBack Event's message: which mode failed, for how long, the kernel's error."""
    why = error or "no sync attempted (the lists did not finish)"
    if len(why) > ERROR_LIMIT:
        why = why[: ERROR_LIMIT - 3] + "..."
    return f"{mode} never synced within {deadline:.0f}s: {why}; serving with {to} again"
