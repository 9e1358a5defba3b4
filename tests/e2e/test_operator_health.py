"""Issue #24: the operator's metrics (reconciles, errors, durations, leadership) on its metrics
port, /healthz from its watch and its leadership, /readyz, and its JSON logs, against the
real apiserver: a leader and a standby, and a standby whose identity loses the right to list
ProxyConfigurations (what its watch needs) turns unhealthy, then healthy again."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_operator import (  # noqa: F401  (env: the module's fixture)
    NS,
    Env,
    Operator,
    env,
    example,
    wait_until,
)

from kpx_cluster.kubeconfig import write_kubeconfig

pytestmark = pytest.mark.e2e

PROBE_SA = "kpx-operator-probe-e2e"


def get(port: int, path: str) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            body = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(), exc.code
    except OSError:
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def sample(op: Operator, name: str, **labels: str) -> float | None:
    status, text = get(op.metrics_port, "/metrics")
    assert status == 200, text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return float(s.value)
    return None


@pytest.fixture(scope="module")
def leader_json(env: Env) -> Iterator[Operator]:  # noqa: F811
    op = env.start_operator("--logging-format=json", "-v", "2")
    wait_until(op.is_leader, 20, "the operator leads")
    yield op
    op.stop()


def test_the_leader_counts_its_reconciles_and_is_ready(env: Env, leader_json: Operator) -> None:  # noqa: F811
    op = leader_json
    env.apply(example("proxyconfig.yaml"))
    wait_until(
        lambda: (
            (sample(op, "kpx_operator_reconciles_total", handler="resync", result="success") or 0)
            >= 2
        ),
        30,
        "resync runs counted",
    )
    assert (sample(op, "kpx_operator_reconcile_duration_seconds_count", handler="resync") or 0) >= 2
    assert sample(op, "kpx_operator_reconcile_errors_total", handler="resync") == 0
    assert sample(op, "kpx_operator_leader") == 1
    assert (sample(op, "process_resident_memory_bytes") or 0) > 1e6
    status, body = get(op.health_port, "/readyz")
    assert status == 200 and body["role"] == "leading" and body["watching"], body
    status, body = get(op.health_port, "/healthz")
    assert status == 200 and body["leader"] and body["problems"] == [], body


def test_the_operator_logs_json_lines_with_klog_keys(leader_json: Operator) -> None:
    lines = [ln for ln in leader_json.log.read_text().splitlines() if ln.strip()]
    assert lines
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    for record in records:
        assert {"ts", "caller", "msg", "logger"} <= record.keys(), record
        assert isinstance(record["ts"], float)
        assert ("v" in record) != ("level" in record), record
    assert any(r["msg"].startswith("leading as") and r["v"] == 0 for r in records), records
    assert not any(r.get("v") == 4 for r in records)  # -v 2: no debug lines


@pytest.fixture
def probe_identity(env: Env) -> Iterator[Any]:  # noqa: F811
    """A service account bound to the operator's roles (ClusterRoleBinding and RoleBinding
    of our own, so that the test can take them away); its kubeconfig."""
    env.kubectl("-n", NS, "create", "serviceaccount", PROBE_SA)
    binding = [
        "clusterrolebinding",
        PROBE_SA,
        "--clusterrole=kpx-operator",
        f"--serviceaccount={NS}:{PROBE_SA}",
    ]
    env.kubectl("create", *binding)
    env.kubectl(
        "-n",
        NS,
        "create",
        "rolebinding",
        PROBE_SA,
        "--role=kpx-operator",
        f"--serviceaccount={NS}:{PROBE_SA}",
    )
    token = env.kubectl("-n", NS, "create", "token", PROBE_SA, "--duration=1h").stdout.strip()
    token_file = env.workdir / "probe.token"
    token_file.write_text(token)
    kubeconfig = write_kubeconfig(
        env.workdir / "probe.kubeconfig",
        server=env.cluster.server,
        ca=env.cluster.ca_file,
        user=f"system:serviceaccount:{NS}:{PROBE_SA}",
        token_file=token_file,
    )
    yield kubeconfig, binding
    env.kubectl("delete", "clusterrolebinding", PROBE_SA, "--ignore-not-found", check=False)
    env.kubectl(
        "-n",
        NS,
        "delete",
        "rolebinding,serviceaccount",
        PROBE_SA,
        "--ignore-not-found",
        check=False,
    )


def test_a_standby_is_ready_and_its_health_follows_its_watch(
    env: Env,  # noqa: F811
    leader_json: Operator,
    probe_identity: Any,
) -> None:
    kubeconfig, binding = probe_identity
    standby = env.start_operator("--health-probe-interval", "0.5", kubeconfig=kubeconfig)
    try:
        wait_until(lambda: get(standby.health_port, "/readyz")[0] == 200, 20, "standby ready")
        _, body = get(standby.health_port, "/readyz")
        assert body["role"] == "standby" and not body["leader"], body
        assert sample(standby, "kpx_operator_leader") == 0
        # Its identity may no longer list ProxyConfigurations: what its watch needs is gone.
        env.kubectl("delete", "clusterrolebinding", PROBE_SA)
        wait_until(lambda: get(standby.health_port, "/healthz")[0] == 503, 20, "unhealthy")
        _, body = get(standby.health_port, "/healthz")
        assert any("watch" in p and "forbidden" in p.lower() for p in body["problems"]), body
        assert get(standby.health_port, "/readyz")[0] == 503
        assert leader_json.is_leader()  # the leader's own identity still may
        env.kubectl("create", *binding)
        wait_until(lambda: get(standby.health_port, "/healthz")[0] == 200, 20, "healthy again")
    finally:
        standby.stop()
