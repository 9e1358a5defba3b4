"""docs/metrics.md is the one table of every metric: each metric the agent registers in any mode
and each the operator serves has a row naming it, with its type and label names; no row names a
metric nobody serves; kpx's own counters end in `_total` and nothing else does."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from kpx_agent.observability.metrics import AgentMetrics
from kpx_operator.metrics import OperatorMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
AGENT_MODES = ("nftables", "iptables", "ipvs", "external")
#: name -> (type, label names), of what is served.
Served = dict[str, tuple[str, set[str]]]


def rows(section: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type cell, label names) of each row of the section's table."""
    text = DOC.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        labels = set(re.findall(r"`(\w+)`", cells[2]))
        for name in re.findall(r"`(\w+)`", cells[0]):
            out[name] = (cells[1], labels)
    return out


def exposed_name(family_name: str, kind: str) -> str:
    return f"{family_name}_total" if kind == "counter" else family_name


def declared_labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Family name -> label names, of the collectors that declare them (series or not)."""
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):
        names = getattr(collector, "_labelnames", None)
        name = getattr(collector, "_name", None)
        if names is not None and name is not None:
            out[name] = set(names)
    return out


def agent_metrics() -> Served:
    served: Served = {}
    for mode in AGENT_MODES:
        registry: CollectorRegistry = AgentMetrics(mode).registry
        declared = declared_labels(registry)
        for family in registry.collect():
            labels = {k for s in family.samples for k in s.labels if k != "le"}
            labels |= declared.get(family.name, set())
            name = exposed_name(family.name, family.type)
            before = served.get(name, (family.type, set()))[1]
            served[name] = (family.type, before | labels)
    return served


def operator_metrics() -> Served:
    served: Served = {}
    for family in text_string_to_metric_families(OperatorMetrics().exposition()):
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        served[exposed_name(family.name, family.type)] = (family.type, labels)
    return served


def check(served: Served, documented: dict[str, tuple[str, set[str]]]) -> None:
    assert sorted(set(served) - set(documented)) == [], "served, not in docs/metrics.md"
    assert sorted(set(documented) - set(served)) == [], "in docs/metrics.md, served by none"
    for name, (kind, labels) in served.items():
        cell, doc_labels = documented[name]
        # A row may group several metrics (process_*): its type cell names each of their types.
        assert kind.rstrip("s") in cell or f"{kind}s" in cell, (name, kind, cell)
        assert labels == doc_labels, (name, labels, doc_labels)


def test_every_agent_metric_has_its_row() -> None:
    served = agent_metrics()
    assert len(served) > 40  # not vacuous: every mode's registry was read
    check(served, rows("## The agent's metrics"))


def test_every_operator_metric_has_its_row() -> None:
    served = operator_metrics()
    assert {
        "kpx_operator_reconciles_total",
        "kpx_operator_reconcile_errors_total",
        "kpx_operator_reconcile_duration_seconds",
    } <= set(served)
    check(served, rows("## The operator's metrics and health"))


def test_kpx_counters_end_in_total_and_nothing_else_does() -> None:
    """Prometheus naming for kpx's own metrics (upstream's keep upstream's names, e.g. the
    gauge kubeproxy_sync_proxy_rules_no_local_endpoints_total)."""
    for name, (kind, _) in {**agent_metrics(), **operator_metrics()}.items():
        if name.startswith("kpx_"):
            assert name.endswith("_total") == (kind == "counter"), (name, kind)
