"""One log line per sync: mode, full or partial, counts and duration, as fields a structured
log (--logging-format=json) carries as keys."""

from __future__ import annotations

import logging

from .proxier import SyncOutcome

log = logging.getLogger("kpx_agent.sync")


def sync_fields(mode: str, outcome: SyncOutcome, service_ports: int) -> dict[str, object]:
    return {
        "mode": mode,
        "full": outcome.full,
        "changedServicePorts": outcome.changed_ports,
        "servicePorts": service_ports,
        "durationSeconds": round(outcome.duration, 6),
    }


def log_sync(mode: str, outcome: SyncOutcome, service_ports: int) -> None:
    """A successful sync (a failed one is logged by the proxier, with its error)."""
    fields = sync_fields(mode, outcome, service_ports)
    log.info(
        "synced %s: %s sync, %d service ports changed, %d programmed, %.3f s",
        mode,
        "full" if outcome.full else "partial",
        outcome.changed_ports,
        service_ports,
        outcome.duration,
        extra={"fields": fields},
    )
