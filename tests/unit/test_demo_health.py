"""`make demo`'s ProxyConfiguration and its reading of "healthy" (kpx_cluster.demo): the end
to end check is tests/e2e/test_operator_cluster.py, test_a_fresh_install_reads_healthy_in_every_
condition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kpx_api import ProxyConfiguration
from kpx_cluster import demo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "proxyconfig.yaml"


def cond(type_: str, status: str, reason: str = "R") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": "m"}


def test_the_demo_runs_the_example_with_kinds_conntrack_max_per_core_0() -> None:
    pxc = demo.proxy_configuration()
    example = yaml.safe_load(EXAMPLE.read_text())
    assert pxc["spec"].pop("conntrack") == {"maxPerCore": 0}
    assert pxc == example
    parsed = ProxyConfiguration.model_validate(demo.proxy_configuration())
    assert parsed.spec.conntrack.max_per_core == 0
    assert not parsed.spec.conntrack.leaves_node_alone()  # the timeouts are still applied


def test_healthy_means_every_condition_reads_as_when_all_is_well() -> None:
    healthy = [
        cond("Ready", "True"),
        cond("Progressing", "False"),
        cond("Degraded", "False"),
        cond("Deprecated", "False"),
        cond("Preflight", "True"),
        cond("Reconciling", "False"),
        cond("Stalled", "False"),
    ]
    assert demo.unhealthy_conditions({"status": {"conditions": healthy}}) == {}
    degraded = [*healthy[:2], cond("Degraded", "True", "ConntrackNotApplied"), *healthy[3:]]
    assert demo.unhealthy_conditions({"status": {"conditions": degraded}}) == {
        "Degraded": "True ConntrackNotApplied: m"
    }
    # No status yet is not healthy.
    assert set(demo.unhealthy_conditions({})) == {
        "Ready",
        "Progressing",
        "Degraded",
        "Deprecated",
        "Reconciling",
        "Stalled",
    }


def test_healthy_names_every_condition_type_the_operator_reports() -> None:
    """A condition type added to the API without its healthy reading here would keep the demo
    (and the e2e check) waiting forever."""
    from kpx_api.proxyconfiguration import ConditionType

    assert set(demo.HEALTHY) == {t.value for t in ConditionType}
