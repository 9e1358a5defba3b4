"""The operator's health (watch, leadership) and metrics, as pure state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_chart import helm_env, render, the  # noqa: F401  (helm_env: a fixture)

from kpx_operator.health import LEADING, STANDBY, STOPPED, OperatorHealth
from kpx_operator.metrics import OperatorMetrics


def test_starting_is_alive_but_not_ready() -> None:
    h = OperatorHealth()
    assert h.healthz()[0] == 200
    assert h.readyz()[0] == 503


def test_a_standby_whose_probe_answers_is_ready() -> None:
    h = OperatorHealth(role=STANDBY)
    assert h.readyz()[0] == 503  # no answer yet
    h.probed(None)
    code, body = h.readyz()
    assert code == 200 and body["role"] == "standby" and body["leader"] is False


def test_a_leader_is_ready_once_kopf_watches() -> None:
    h = OperatorHealth(role=LEADING)
    h.probed(None)
    assert h.readyz()[0] == 503
    h.watching = True
    assert h.readyz() == (
        200,
        {"ok": True, "role": "leading", "leader": True, "watching": True, "problems": []},
    )


def test_failed_probes_in_a_row_make_it_unhealthy_and_one_answer_heals() -> None:
    h = OperatorHealth(role=LEADING, watching=True)
    for _ in range(2):
        h.probed("ApiError: 403 Forbidden")
    assert h.healthz()[0] == 200  # two failures are allowed
    h.probed("ApiError: 403 Forbidden")
    code, body = h.healthz()
    assert code == 503 and "403 Forbidden" in str(body["problems"])
    assert h.readyz()[0] == 503
    h.probed(None)
    assert h.healthz()[0] == 200


def test_a_leader_past_its_lease_deadline_or_stopped_is_unhealthy() -> None:
    left = [5.0]
    h = OperatorHealth(role=LEADING, watching=True, lease_left=lambda: left[0])
    assert h.healthz()[0] == 200
    left[0] = 0.0
    assert "Lease" in str(h.healthz()[1]["problems"])
    h2 = OperatorHealth(role=LEADING, leader_elect=False, lease_left=lambda: 0.0)
    assert h2.healthz()[0] == 200  # no election: no Lease to renew
    assert OperatorHealth(role=STOPPED).healthz()[0] == 503
    assert OperatorHealth(operator_ended="RuntimeError()").healthz()[0] == 503


class Later(Exception):
    pass


def test_handler_runs_are_counted_by_result_with_durations() -> None:
    m = OperatorMetrics()

    async def ok() -> int:
        return 1

    async def fail() -> int:
        raise RuntimeError("no")

    async def later() -> int:
        raise Later()

    async def run() -> None:
        assert await m.timed("resync", ok) == 1
        with pytest.raises(RuntimeError):
            await m.timed("resync", fail)
        with pytest.raises(Later):
            await m.timed("cleanup", later, requeue=(Later,))

    asyncio.run(run())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.exposition())
        for s in f.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("kpx_operator_reconciles_total", handler="resync", result="success") == 1
    assert value("kpx_operator_reconciles_total", handler="resync", result="error") == 1
    assert value("kpx_operator_reconciles_total", handler="cleanup", result="requeue") == 1
    assert value("kpx_operator_reconcile_errors_total", handler="resync") == 1
    assert value("kpx_operator_reconcile_errors_total", handler="cleanup") == 0
    assert value("kpx_operator_reconcile_duration_seconds_count", handler="resync") == 2
    assert value("kpx_operator_reconcile_duration_seconds_bucket", handler="resync", le="+Inf") == 2
    assert value("process_cpu_seconds_total") > 0
    assert value("process_resident_memory_bytes") > 1e6
    assert value("process_open_fds") > 0


REPO = Path(__file__).resolve().parents[2]


def operator_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def assert_probes_and_ports(container: dict[str, Any]) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}


def test_the_kustomize_deployment_probes_readyz_and_declares_the_metrics_port() -> None:
    docs = yaml.safe_load_all((REPO / "operator/manifests/deployment.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    assert_probes_and_ports(operator_container(deployment))


def test_the_charts_deployment_probes_readyz_and_declares_the_metrics_port(
    helm_env: dict[str, str],  # noqa: F811
) -> None:
    deployment = the(render(helm_env), "Deployment")
    assert_probes_and_ports(operator_container(deployment))
