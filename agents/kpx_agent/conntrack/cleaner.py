"""Stale conntrack deletions off the programming path: a bounded queue and one worker.

After a sync commits, the proxier hands the stale-flow filters (conntrack.stale_flows) to
`ConntrackCleaner.submit`, which only queues them and returns: the sync never waits for the
kernel's conntrack table, whose dump grows with the node's traffic. One worker thread takes
everything queued (the filters of several syncs together, each filter once), runs the
deletions within their time budget (conntrack.delete_flows: one dump per IP family) and reports
them (`report`: duration, entries deleted, failures). It runs only while there is work: it
exits when the queue is empty and the next `submit` starts another.

Bounded: at most `capacity` filters wait; what a full queue refuses is counted as failed and
logged, never waited for. A failing deletion (EPERM, no nf_conntrack, a garbled answer, an
exception of the deleting function itself) is logged and counted; nothing reaches the sync.
Only the worker reports (the metrics it updates have one writer).

A deletion runs after the sync that called for it, usually at once; behind a long batch it
may run after a later sync brought the endpoint back, and then deletes that endpoint's flows
made meanwhile (their next datagram makes a new entry). Deletions still queued when the agent
exits are lost; the next agent's first sync deletes the not-DNATed entries again, and those
DNATed to an address that is no longer a serving endpoint (stale_flows.reconcile_flows).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from .stale_flows import FlowFilter

log = logging.getLogger(__name__)

#: Filters that may wait: more than an agent's start or a repair calls for at 30,000 dual-stack
#: Services (a filter per ClusterIP of every port; about 120 bytes each while queued).
CAPACITY = 100_000

#: The deletions of one batch: the filters -> how many deletions failed.
Delete = Callable[[list[FlowFilter]], int]
#: After each batch: the IP families it had filters in, its duration, how many failed.
Report = Callable[[list[int], float, int], None]


class ConntrackCleaner:
    def __init__(self, delete: Delete, report: Report, capacity: int = CAPACITY) -> None:
        self._delete = delete
        self._report = report
        self.capacity = capacity
        self._pending: dict[FlowFilter, None] = {}  # insertion-ordered, each filter once
        self._lock = threading.Condition()
        self._worker: threading.Thread | None = None
        self._refused = 0  # filters a full queue refused: the worker reports them (one writer)

    def submit(self, filters: Iterable[FlowFilter]) -> None:
        """Queue deletions; never blocks and never raises."""
        refused = 0
        with self._lock:
            for flow in filters:
                if flow in self._pending:
                    continue
                if len(self._pending) >= self.capacity:
                    refused += 1  # the queue is full, so a worker runs and will report it
                    continue
                self._pending[flow] = None
            self._refused += refused
            if self._pending and self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="conntrack-cleaner", daemon=True
                )
                self._worker.start()
        if refused:
            log.warning(
                "conntrack cleanup: queue full (%d filters waiting); %d deletions dropped",
                self.capacity,
                refused,
            )

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running (tests, shutdown); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._worker is None, timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._worker = None
                    self._lock.notify_all()
                    return
                batch = list(self._pending)
                self._pending.clear()
                refused, self._refused = self._refused, 0
            started = time.monotonic()
            try:
                failures = self._delete(batch)
            except Exception:  # the deleting function's own bug must not kill the worker
                log.exception("conntrack cleanup failed")
                failures = len(batch)
            families = sorted({f.family for f in batch})
            self._safe_report(families, time.monotonic() - started, failures + refused)

    def _safe_report(self, families: list[int], duration: float, failures: int) -> None:
        try:
            self._report(families, duration, failures)
        except Exception:
            log.exception("conntrack cleanup: reporting failed")
