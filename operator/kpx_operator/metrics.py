"""The operator's Prometheus metrics (docs/metrics.md): handler runs by handler and result,
their errors and durations, leadership, and the process (`process_*`, read from /proc).

Written out in the Prometheus text format here: the operator's image carries no metrics
library (images/requirements-operator.txt), and these few series need none.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import resource
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: controller-runtime's reconcile time buckets.
RECONCILE_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.45,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    6.0,
    7.0,
    8.0,
    9.0,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
#: The handlers (kopf ids) whose runs are counted.
HANDLERS = ("reconcile", "resync", "cleanup")
#: Results: success, requeue (not finished: kopf calls again later), error.
SUCCESS, REQUEUE, ERROR = "success", "requeue", "error"
RESULTS = (SUCCESS, REQUEUE, ERROR)

T = TypeVar("T")


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    text = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in pairs
    )
    return "{" + text + "}" if text else ""


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: tuple[tuple[str, str], ...]) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            le = _labels((*labels, ("le", _number(bound))))
            out.append(f"{name}_bucket{le} {cumulative}")
        out.append(f"{name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


def process_metrics() -> list[str]:
    """process_* as the Go and Python clients name them, from this process's /proc entry."""
    out: list[str] = []
    t = os.times()
    out += [
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
        "# TYPE process_cpu_seconds_total counter",
        f"process_cpu_seconds_total {_number(t.user + t.system)}",
    ]
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        statm = Path("/proc/self/statm").read_text().split()
        out += [
            "# HELP process_resident_memory_bytes Resident memory size in bytes.",
            "# TYPE process_resident_memory_bytes gauge",
            f"process_resident_memory_bytes {int(statm[1]) * page}",
            "# HELP process_virtual_memory_bytes Virtual memory size in bytes.",
            "# TYPE process_virtual_memory_bytes gauge",
            f"process_virtual_memory_bytes {int(statm[0]) * page}",
        ]
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        start = boot + int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        out += [
            "# HELP process_start_time_seconds Start time of the process since unix epoch "
            "in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {_number(start)}",
        ]
        fds = len(os.listdir("/proc/self/fd"))
        out += [
            "# HELP process_open_fds Number of open file descriptors.",
            "# TYPE process_open_fds gauge",
            f"process_open_fds {fds}",
        ]
    except (OSError, ValueError, IndexError, StopIteration):
        pass  # no /proc: only the CPU time
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    out += [
        "# HELP process_max_fds Maximum number of open file descriptors.",
        "# TYPE process_max_fds gauge",
        f"process_max_fds {soft}",
    ]
    return out


class OperatorMetrics:
    def __init__(self) -> None:
        self.reconciles = {(h, r): 0 for h in HANDLERS for r in RESULTS}
        self.errors = dict.fromkeys(HANDLERS, 0)
        self.durations = {h: Histogram(RECONCILE_BUCKETS) for h in HANDLERS}
        self.leader = 0

    def record(self, handler: str, result: str, seconds: float) -> None:
        self.reconciles[(handler, result)] = self.reconciles.get((handler, result), 0) + 1
        if result == ERROR:
            self.errors[handler] = self.errors.get(handler, 0) + 1
        self.durations.setdefault(handler, Histogram(RECONCILE_BUCKETS)).observe(seconds)

    async def timed(
        self,
        handler: str,
        run: Callable[[], Awaitable[T]],
        requeue: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Run one handler, counted: an exception in `requeue` is a requeue, any other an
        error (both raised again); a cancellation (the operator stops) is not counted."""
        started = time.monotonic()
        result: str | None = ERROR
        try:
            out = await run()
            result = SUCCESS
            return out
        except requeue:
            result = REQUEUE
            raise
        except asyncio.CancelledError:
            result = None
            raise
        finally:
            if result is not None:
                self.record(handler, result, time.monotonic() - started)

    def exposition(self) -> str:
        """Everything, in the Prometheus text format."""
        out = [
            "# HELP kpx_operator_reconciles_total Handler runs on ProxyConfigurations, by "
            "handler (reconcile: a spec change; resync: the timer; cleanup: a deletion) and "
            "result (success, requeue, error)",
            "# TYPE kpx_operator_reconciles_total counter",
        ]
        for (handler, result), count in sorted(self.reconciles.items()):
            labels = _labels((("handler", handler), ("result", result)))
            out.append(f"kpx_operator_reconciles_total{labels} {count}")
        out += [
            "# HELP kpx_operator_reconcile_errors_total Handler runs that raised an error "
            "(kopf retries them)",
            "# TYPE kpx_operator_reconcile_errors_total counter",
        ]
        for handler, count in sorted(self.errors.items()):
            out.append(
                f"kpx_operator_reconcile_errors_total{_labels([('handler', handler)])} {count}"
            )
        out += [
            "# HELP kpx_operator_reconcile_duration_seconds Time of one handler run, by handler",
            "# TYPE kpx_operator_reconcile_duration_seconds histogram",
        ]
        for handler, histogram in sorted(self.durations.items()):
            out += histogram.lines(
                "kpx_operator_reconcile_duration_seconds", (("handler", handler),)
            )
        out += [
            "# HELP kpx_operator_leader 1 while this replica holds the leader Lease",
            "# TYPE kpx_operator_leader gauge",
            f"kpx_operator_leader {self.leader}",
        ]
        out += process_metrics()
        return "\n".join(out) + "\n"
