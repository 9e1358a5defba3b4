"""The results of a comparison run (bench/compare.py) and their one report: the markdown table
with its details, and the JSON written to bench/results/.

Pure: the driver measures and fills `SizeResult`; `report` and `to_json` only read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib import machine_line, markdown_table, median, percentile
from kpx_cluster.binaries import KUBERNETES_VERSION
from ruleset_readback import Comparison
from workload import ENDPOINTS_PER_SERVICE

MODES = ("nftables", "iptables")
KUBE_PROXY, KPX = "kube-proxy", "kpx"
SYSTEMS = (KUBE_PROXY, KPX)


# ---- what a run measured -----------------------------------------------------------------------


@dataclass
class ColdStart:
    seconds: float = 0.0  # process start -> the poll that saw all N ended
    confirmed_s: float = 0.0  # ... -> the full listing that confirmed them ended
    timed_out: bool = False
    polls: int = 0
    poll_ms: float = 0.0  # mean duration of one poll
    cpu_s: float = 0.0  # the process, at detection
    children_cpu_s: float = 0.0
    apiserver_cpu_s: float = 0.0


@dataclass
class Change:
    service: int
    latency_ms: float
    ack_ms: float
    polls: int


@dataclass
class Burst:
    size: int = 0
    latency_ms: float = 0.0  # first PATCH sent -> all `size` Services seen with the new endpoint
    sentinel_ms: float = 0.0  # ... -> the Service with the newest resourceVersion seen
    acked_ms: float = 0.0  # ... -> every PATCH acknowledged
    verified_ms: float = 0.0  # ... -> the pass that checked all of them ended
    passes: int = 0


@dataclass
class Sustained:
    """`size` EndpointSlice changes (distinct Services) sent in batches spread over `seconds`,
    each stamped with the trigger-time annotation as it is sent."""

    size: int = 0
    seconds: float = 0.0
    sent_ms: float = 0.0  # first PATCH -> the last acknowledged
    all_in_ms: float | None = None  # first PATCH -> every change read back from the kernel
    missing: int = 0  # changes not in the kernel when the wait ended
    # kubeproxy_network_programming_duration_seconds over the burst (the bound of the bucket
    # the quantile falls in; both systems use upstream's buckets)
    observed: int = 0
    p50_s: float | None = None
    p99_s: float | None = None


@dataclass
class Work:
    """What one phase cost the process (differences between its start and its end)."""

    events: int = 0
    cpu_s: float = 0.0  # the process's own
    children_cpu_s: float = 0.0  # its `nft` / `iptables-restore` children
    full_syncs: float = 0.0
    partial_syncs: float = 0.0
    service_changes: float = 0.0  # Service changes seen (..._service_changes_total, both)


@dataclass
class SystemResult:
    system: str
    mode: str
    colds: list[ColdStart] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    change_poll_ms: float = 0.0
    burst: Burst | None = None
    sustained: Sustained | None = None
    cpu_cold_s: float = 0.0  # process + children, at the last cold start's detection
    cpu_end_s: float = 0.0  # ... after changes and burst
    measured_s: float = 0.0  # last start -> end of the changes and burst
    peak_rss_mb: float = 0.0
    rss_end_mb: float = 0.0
    ruleset: dict[str, int] = field(default_factory=dict)  # at the end
    ruleset_cold: dict[str, int] = field(default_factory=dict)  # after the last cold start
    metrics: dict[str, float] = field(default_factory=dict)
    node_work: Work | None = None  # the Node status updates, when measured
    readback_s: list[float] = field(default_factory=list)
    # A stopped iptables kube-proxy: the size of the ruleset it was loading, from its log.
    ruleset_from_log: dict[str, int] = field(default_factory=dict)
    error: str = ""
    log_tail: str = ""

    @property
    def completed(self) -> list[float]:
        return [c.seconds for c in self.colds if not c.timed_out]

    @property
    def timed_out(self) -> bool:
        return any(c.timed_out for c in self.colds)

    def latencies(self) -> list[float]:
        return [c.latency_ms for c in self.changes]


@dataclass(frozen=True)
class Options:
    changes: int = 20
    burst: int = 100
    gap: float = 1.2
    cold_starts: int = 3
    cold_timeout: float = 600.0
    modes: tuple[str, ...] = MODES
    systems: tuple[str, ...] = SYSTEMS
    node_updates: int = 0  # Node status updates after the burst (0: none)
    sustained: int = 0  # EndpointSlice changes of the sustained burst (0: none)
    sustained_seconds: float = 10.0  # ... spread over this long
    agent_args: tuple[str, ...] = ()  # extra kpx agent flags, e.g. -v
    write: bool = True
    keep_dumps: Path | None = None  # save each system's final ruleset dumps under <N>/ here


@dataclass
class ModeResult:
    mode: str
    systems: dict[str, SystemResult] = field(default_factory=dict)
    equivalence: dict[str, Comparison] = field(default_factory=dict)


@dataclass
class SizeResult:
    services: int
    modes: dict[str, ModeResult]
    creation: list[dict[str, Any]]
    run_seconds: float
    load_average: tuple[float, float, float]


# ---- the report ------------------------------------------------------------------------------


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 100 else f"{x:,.0f} s"


def _ms(x: float) -> str:
    return f"{x:,.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _ratio(ours: float | None, theirs: float | None, theirs_lower_bound: bool = False) -> str:
    if ours is None or theirs is None or theirs <= 0:
        return "n/a"
    r = ours / theirs
    text = f"{r:.3f}" if r < 0.1 else f"{r:.2f}"
    if theirs_lower_bound:
        return f"< {text}"
    return f"**{text}**" if r > 1 else text


@dataclass(frozen=True)
class Figure:
    name: str
    value: Callable[[SystemResult], float | None]
    fmt: Callable[[float], str]


def _cold(r: SystemResult) -> float | None:
    return median(r.completed) if r.completed else None


def _p(q: float) -> Callable[[SystemResult], float | None]:
    def get(r: SystemResult) -> float | None:
        lat = r.latencies()
        return percentile(lat, q) if lat else None

    return get


def _burst(r: SystemResult) -> float | None:
    return r.burst.latency_ms if r.burst else None


def _mb(x: float) -> str:
    return f"{x:.0f} MB"


def _bytes(x: float) -> str:
    return f"{x / 1e6:.1f} MB"


def _count(x: float) -> str:
    return f"{x:,.0f}"


def _ruleset(key: str) -> Callable[[SystemResult], float | None]:
    """The ruleset at one apiserver state: kube-proxy's at its end, kpx's after its cold start
    (nothing changed in between; the element count depends on the state: endpoints shared by
    two Services stay in the hairpin set when one of them changes)."""

    def get(r: SystemResult) -> float | None:
        src = r.ruleset_cold if r.system == KPX and r.ruleset_cold else r.ruleset
        return float(src[key]) if key in src else None

    return get


def _cpu_changes(r: SystemResult) -> float | None:
    return r.cpu_end_s - r.cpu_cold_s if r.cpu_end_s else None


def figures(opts: Options, n_cold: int) -> list[Figure]:
    return [
        Figure(
            f"cold start: process start -> all N Services in the kernel (median of {n_cold})",
            _cold,
            _s,
        ),
        Figure(f"single change -> in the kernel, median of {opts.changes}", _p(50), _ms),
        Figure("single change, p90", _p(90), _ms),
        Figure(
            f"burst: {opts.burst} EndpointSlices changed at once -> all in the kernel", _burst, _ms
        ),
        Figure(
            "CPU, process + children (nft, iptables-restore): cold start",
            lambda r: r.cpu_cold_s or None,
            _s,
        ),
        Figure("CPU, process + children: after the cold start (changes, bursts)", _cpu_changes, _s),
        Figure("peak RSS of the process (VmHWM)", lambda r: r.peak_rss_mb or None, _mb),
        Figure(
            "ruleset: lines (`nft list ruleset`; iptables-save + ip6tables-save)",
            _ruleset("lines"),
            _count,
        ),
        Figure("ruleset: size of that listing", _ruleset("bytes"), _bytes),
        Figure("ruleset: chains", _ruleset("chains"), _count),
        Figure("ruleset: rules", _ruleset("rules"), _count),
        Figure("ruleset: set and map elements", _ruleset("elements"), _count),
        *_sustained_figures(opts),
        *_node_figures(opts),
    ]


def _sustained_figures(opts: Options) -> list[Figure]:
    if not opts.sustained:
        return []

    def all_in(r: SystemResult) -> float | None:
        return r.sustained.all_in_ms if r.sustained else None

    def quantile(name: str) -> Callable[[SystemResult], float | None]:
        return lambda r: getattr(r.sustained, name) if r.sustained else None

    what = f"{opts.sustained:,} EndpointSlice changes over {opts.sustained_seconds:g} s"
    return [
        Figure(f"sustained: {what} -> all in the kernel, from the first", all_in, _ms),
        Figure(
            "sustained: network programming p50 (its metric; SLO: p99 <= 30 s)",
            quantile("p50_s"),
            _s_le,
        ),
        Figure("sustained: network programming p99", quantile("p99_s"), _s_le),
    ]


def bucket_quantile(cumulative: Mapping[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` (None: no observation; inf: above
    the last finite bound)."""
    total = cumulative.get(float("inf"), 0.0)
    if total <= 0:
        return None
    return next(le for le in sorted(cumulative) if cumulative[le] >= q * total)


def _s_le(x: float) -> str:
    return f"<= {x:g} s"


def _node_figures(opts: Options) -> list[Figure]:
    if not opts.node_updates:
        return []
    return [
        Figure(
            f"{opts.node_updates} Node status updates: CPU, process + children",
            lambda r: r.node_work.cpu_s + r.node_work.children_cpu_s if r.node_work else None,
            _s,
        ),
        Figure(
            f"{opts.node_updates} Node status updates: syncs (full + partial)",
            lambda r: r.node_work.full_syncs + r.node_work.partial_syncs if r.node_work else None,
            _count,
        ),
    ]


def _cell(fig: Figure, r: SystemResult | None, timeout: float) -> tuple[str, float | None, bool]:
    """(text, value, value is a lower bound)."""
    if r is None:
        return "not run", None, False
    if r.timed_out and fig.value is _cold:
        limit = f"{timeout / 60:.0f} min" if timeout >= 120 else f"{timeout:.1f} s"
        return f"> {limit} (stopped)", timeout, True
    if r.timed_out and (
        fig.name.startswith(("single", "burst", "sustained", "CPU, process + children: the"))
        or "Node status updates" in fig.name
    ):
        return "skipped (no cold start)", None, False
    if r.timed_out and fig.name.startswith(("CPU", "peak RSS")):
        value = fig.value(r)
        if value is not None:  # what it had used when stopped: a lower bound
            return f">= {fig.fmt(value)} (when stopped)", value, True
    if r.timed_out and fig.name.startswith("ruleset"):
        key = fig.name.split(": ")[1].split()[0]
        if key in r.ruleset_from_log:
            value = float(r.ruleset_from_log[key])
            return f"{fig.fmt(value)} (being loaded when stopped; IPv4, from its log)", value, False
        return "none committed", None, False
    value = fig.value(r)
    if value is None and r.sustained and r.sustained.missing and "all in the kernel" in fig.name:
        return f"not all: {r.sustained.missing:,} missing", None, False
    if value is None:
        return ("failed" if r.error else "n/a"), None, False
    return fig.fmt(value), value, False


def report(size: SizeResult, info: Mapping[str, str], opts: Options, command: str) -> str:
    n = size.services
    headers = ["figure"]
    for mode_name in size.modes:
        headers += [f"kube-proxy {mode_name}", f"kpx {mode_name}", "kpx / kube-proxy"]
    rows = []
    for fig in figures(opts, opts.cold_starts):
        row = [fig.name]
        for mode in size.modes.values():
            up_text, up, up_bound = _cell(fig, mode.systems.get(KUBE_PROXY), opts.cold_timeout)
            ours_text, ours, _ = _cell(fig, mode.systems.get(KPX), opts.cold_timeout)
            row += [up_text, ours_text, _ratio(ours, up, up_bound)]
        if any(c not in ("n/a", "not run") for c in row[1:]):
            rows.append(row)
    eq_row = ["equivalence (Service IP, port) -> endpoints, read back from the kernel"]
    for mode in size.modes.values():
        ok = mode.equivalence and all(c.equal for c in mode.equivalence.values())
        verdict = ("equal" if ok else "**see below**") if mode.equivalence else "n/a"
        if ok and not any(name.startswith(KUBE_PROXY) for name in mode.equivalence):
            verdict = "kpx = apiserver state (no kube-proxy ruleset to compare)"
        eq_row += ["", "", verdict]
    rows.append(eq_row)
    load = " / ".join(f"{x:.2f}" for x in size.load_average)
    text = (
        f"## kube-proxy {KUBERNETES_VERSION} vs kpx at {n:,} Services x "
        f"{ENDPOINTS_PER_SERVICE} endpoints\n\n"
        f"Machine: {machine_line(info)}. Command: `{command}`. "
        f"This size took {size.run_seconds / 60:.1f} min; load average when it started "
        f"(1/5/15 min): {load}.\n\n"
        + markdown_table(headers, rows)
        + "\nRatios are kpx / kube-proxy: below 1 means kpx is lower (better); **bold** means "
        "kpx is behind. Ruleset figures are taken at one apiserver state: kube-proxy's at the "
        "end of its run, kpx's right after its cold start (nothing changed in between).\n\n"
        + "\n".join(f"- {line}" for line in details(size, opts))
        + "\n"
    )
    return text


def details(size: SizeResult, opts: Options) -> list[str]:
    lines = []
    for made in size.creation:
        cpu = ", ".join(f"{k} {v:.1f} s" for k, v in made["control_plane_cpu_s"].items())
        lines.append(
            f"Created Services {made['from']:,}..{made['to'] - 1:,} in {made['services_s']:.1f} s "
            f"and their EndpointSlices in {made['slices_s']:.1f} s ({cpu} of control-plane CPU)."
        )
    for mode, m in size.modes.items():
        for system, r in m.systems.items():
            label = f"{system} {mode}"
            colds = ", ".join(
                ("stopped at " if c.timed_out else "") + _s(c.seconds) for c in r.colds
            )
            parts = [f"**{label}**: cold starts {colds or 'none'}"]
            done = [c for c in r.colds if not c.timed_out]
            if done:
                cold = done[-1]
                parts.append(
                    f" (last: confirmed by a full listing at {_s(cold.confirmed_s)}; "
                    f"{cold.polls} polls of {cold.poll_ms:.1f} ms; apiserver CPU "
                    f"{cold.apiserver_cpu_s:.2f} s)"
                )
            lat = r.latencies()
            if lat:
                parts.append(
                    f"; changes min {_ms(min(lat))} / median {_ms(median(lat))} / p90 "
                    f"{_ms(percentile(lat, 90))} / max {_ms(max(lat))} (PATCH acknowledged in "
                    f"{median([c.ack_ms for c in r.changes]):.1f} ms median; one kernel poll "
                    f"{r.change_poll_ms:.2f} ms)"
                )
            if r.burst:
                b = r.burst
                parts.append(
                    f"; burst: all {b.size} PATCHes acknowledged at {_ms(b.acked_ms)}, newest "
                    f"write in the kernel at {_ms(b.sentinel_ms)}, all {b.size} checked by "
                    f"{_ms(b.verified_ms)} ({b.passes} pass(es))"
                )
            if r.sustained:
                u = r.sustained
                parts.append(
                    f"; sustained: {u.size:,} PATCHes sent over {_ms(u.sent_ms)}, "
                    + (
                        f"all in the kernel at {_ms(u.all_in_ms)}"
                        if u.all_in_ms is not None
                        else f"{u.missing:,} not in the kernel when the wait ended"
                    )
                    + f", {u.observed:,} network-programming observations"
                )
            if r.measured_s:
                parts.append(
                    f"; CPU {r.cpu_cold_s:.2f} s at cold start, {r.cpu_end_s:.2f} s after "
                    f"{r.measured_s:.0f} s running; RSS at the end {r.rss_end_mb:.0f} MB"
                )
            if r.node_work:
                w = r.node_work
                parts.append(
                    f"; {w.events} Node status updates (a heartbeat's: nothing a proxy uses "
                    f"changes): CPU {w.cpu_s:.2f} s (+ {w.children_cpu_s:.2f} s children), "
                    f"{w.full_syncs:.0f} full + {w.partial_syncs:.0f} partial syncs, "
                    f"{w.service_changes:.0f} Service changes"
                )
            sync = _sync_summary(r.metrics)
            if sync:
                parts.append(f"; own metrics: {sync}")
            if r.readback_s:
                parts.append(
                    f"; full dumps for the read-back took {', '.join(_s(x) for x in r.readback_s)}"
                )
            if r.error:
                parts.append(f"; **error**: {r.error.splitlines()[0]}")
            lines.append("".join(parts) + ".")
        for name, comparison in m.equivalence.items():
            lines.append(f"Equivalence ({mode}): {name}: {comparison.summary()}.")
        upstream = m.systems.get(KUBE_PROXY)
        if upstream is not None and upstream.timed_out:
            lines.append(
                f"Equivalence ({mode}): kube-proxy never completed its first sync, so kpx is "
                "compared with the apiserver's state only."
            )
    return lines


def _syncs(m: Mapping[str, float], name: str) -> tuple[float, float] | None:
    """(count, sum) of one sync-duration histogram in one IP family: both systems label it
    by family (`ip_family`), and one sync of both families counts once in each, so the
    family with the most syncs stands for the whole (None: no such series)."""
    series: dict[str, list[float]] = {}
    for k, v in m.items():
        for part, at in (("_count", 0), ("_sum", 1)):
            if k.startswith(name + part) and k[len(name + part) : len(name + part) + 1] in "{":
                series.setdefault(k[len(name + part) :], [0.0, 0.0])[at] += v
    if not series or not max(c for c, _ in series.values()):
        return None
    count, total = max(series.values())
    return count, total


def _sync_summary(m: Mapping[str, float]) -> str:
    out = []
    for kind in ("full", "partial"):
        found = _syncs(m, f"kubeproxy_sync_{kind}_proxy_rules_duration_seconds")
        if found:
            count, total = found
            out.append(f"{count:.0f} {kind} syncs, {total / count:.3f} s mean")
    if not out:
        found = _syncs(m, "kubeproxy_sync_proxy_rules_duration_seconds")
        if found:
            count, total = found
            out.append(f"{count:.0f} syncs, {total / count:.3f} s mean")
    return ", ".join(out) + (" (per IP family)" if out else "")


def to_json(
    size: SizeResult, info: Mapping[str, str], opts: Options, command: str
) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode, m in size.modes.items():
        systems: dict[str, Any] = {}
        for system, r in m.systems.items():
            data = asdict(r)
            lat = r.latencies()
            data["summary"] = {
                "cold_start_s": _cold(r),
                "cold_start_timed_out": r.timed_out,
                "change_median_ms": median(lat) if lat else None,
                "change_p90_ms": percentile(lat, 90) if lat else None,
                "burst_ms": r.burst.latency_ms if r.burst else None,
                "sustained_all_in_ms": r.sustained.all_in_ms if r.sustained else None,
                "sustained_p99_s": r.sustained.p99_s if r.sustained else None,
                "cpu_cold_s": r.cpu_cold_s,
                "cpu_changes_s": _cpu_changes(r),
                "peak_rss_mb": r.peak_rss_mb,
                "node_updates_cpu_s": (
                    r.node_work.cpu_s + r.node_work.children_cpu_s if r.node_work else None
                ),
            }
            systems[system] = data
        modes[mode] = {
            "systems": systems,
            "equivalence": {
                name: {
                    "equal": c.equal,
                    "compared": c.compared,
                    "missing_left": [list(k) for k in c.missing_left[:100]],
                    "missing_right": [list(k) for k in c.missing_right[:100]],
                    "different": [list(k) for k in c.different[:100]],
                    "counts": [len(c.missing_left), len(c.missing_right), len(c.different)],
                    "examples": c.examples,
                    "summary": c.summary(),
                }
                for name, c in m.equivalence.items()
            },
        }
    return {
        "benchmark": "compare",
        "command": command,
        "services": size.services,
        "endpoints_per_service": ENDPOINTS_PER_SERVICE,
        "machine": dict(info),
        "options": {**asdict(opts), "keep_dumps": str(opts.keep_dumps or "") or None},
        "creation": size.creation,
        "run_seconds": round(size.run_seconds, 1),
        "load_average": size.load_average,
        "modes": modes,
    }
