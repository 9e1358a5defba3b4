"""The node-local state API end to end: an agent in mode external (state-server-only) on n1
against the session's real apiserver, and the two example plugins built on the client library:
the JSON-file plugin follows a Service created with kubectl and its endpoint changes within a
second; the userspace TCP proxy carries real TCP traffic from the client pod to a ClusterIP."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import (
    AGENT_PYTHONPATH,
    BACKEND_PORT,
    AgentEnv,
    Svc,
    build_agent_env,
    endpoint_slice,
    kpx_tables,
    service,
    service_port,
    wait_until,
    write_agent_config,
)

from kpx_cluster.controlplane import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "examples" / "plugins"


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[AgentEnv]:
    with build_agent_env(cluster, "nftables", start=False) as shared:
        shared.config = write_agent_config(
            shared.topology.tmpdir / "external.yaml",
            "external",
            extra={"external": {"image": "example.com/plugin:1", "minSyncPeriod": "0s"}},
        )
        shared.mode = "external"
        yield shared


@pytest.fixture(scope="module")
def socket_path(env: AgentEnv) -> Path:
    path = env.topology.tmpdir / "state" / "state.sock"
    env.start_agent("n1", extra_args=["--state-socket", str(path)])
    return path


#: Seconds to wait for a change to reach the plugin through the state API: generous for a busy
#: machine (the test proves the change arrives; its latency is printed, not asserted).
PUSHED_WITHIN = 15.0


def plugin(
    env: AgentEnv, argv: list[str], log: Path, in_node: bool = False
) -> subprocess.Popen[Any]:
    environ = {"PYTHONPATH": AGENT_PYTHONPATH, "PATH": "/usr/bin:/bin"}
    full = ["env", *(f"{k}={v}" for k, v in environ.items()), sys.executable, *argv]
    with log.open("wb") as out:
        if in_node:
            return env.topology.run(env.n1, full, stdout=out, stderr=subprocess.STDOUT)
        return subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[Any]) -> int:
    proc.terminate()
    return proc.wait(timeout=10)


def test_external_agent_programs_no_kernel_rules(env: AgentEnv, socket_path: Path) -> None:
    assert socket_path.exists()
    assert kpx_tables(env.topology, env.n1) == set()


def test_json_plugin_follows_a_service_and_its_endpoints(
    env: AgentEnv, socket_path: Path, agent_ns: str
) -> None:
    out = env.topology.tmpdir / "state.json"
    log = env.topology.tmpdir / "json-plugin.log"
    proc = plugin(
        env,
        [
            str(PLUGINS / "json-file" / "json_file_plugin.py"),
            "--output",
            str(out),
            "--target",
            f"unix://{socket_path}",
        ],
        log,
    )

    def ports() -> dict[str, Any]:
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            return {}
        return {
            p["key"]["name"]: p for p in data["servicePorts"] if p["key"]["namespace"] == agent_ns
        }

    try:
        wait_until(lambda: out.exists(), 10, message=lambda: log.read_text())
        env.kube.kubectl("create", "service", "clusterip", "web", "--tcp=80:8080", "-n", agent_ns)
        t0 = time.monotonic()
        wait_until(
            lambda: "web" in ports(), PUSHED_WITHIN, interval=0.02, message=lambda: log.read_text()
        )
        print(f"\nService seen after {time.monotonic() - t0:.2f} s")
        assert ports()["web"].get("cluster_endpoints", []) == []
        ep = env.backend_endpoints(4, ("b1",))
        env.kube.apply(endpoint_slice("web-1", agent_ns, "web", ep, [("80-8080", 8080, "TCP")]))
        t0 = time.monotonic()
        wait_until(
            lambda: ports()["web"].get("cluster_endpoints"),
            PUSHED_WITHIN,
            interval=0.02,
            message=lambda: log.read_text(),
        )
        print(f"\nendpoint change seen after {time.monotonic() - t0:.2f} s")
        (endpoint,) = ports()["web"]["cluster_endpoints"]
        assert (endpoint["ip"], endpoint["port"]) == (env.pods["b1"].ipv4, 8080)
        conditions = ("ready", "serving", "terminating")
        assert [endpoint[c] for c in conditions] == [True, True, False]
        # The pod terminates while still serving, with no other endpoint: the fallback,
        # served with its conditions.
        ep[0]["conditions"] = {"ready": False, "serving": True, "terminating": True}
        env.kube.apply(endpoint_slice("web-1", agent_ns, "web", ep, [("80-8080", 8080, "TCP")]))
        t0 = time.monotonic()
        wait_until(
            lambda: ports()["web"]["cluster_endpoints"][0]["terminating"],
            PUSHED_WITHIN,
            interval=0.02,
            message=lambda: log.read_text(),
        )
        print(f"\nterminating endpoint seen after {time.monotonic() - t0:.2f} s")
        (endpoint,) = ports()["web"]["cluster_endpoints"]
        assert [endpoint[c] for c in conditions] == [False, True, True]
        # The node's decided facts, per family (n1's InternalIP is known to the agent).
        facts = {f["family"]: f for f in json.loads(out.read_text())["nodeFacts"]}
        assert sorted(facts) == [4, 6]
        assert f"{env.n1.ipv4}/32" in facts[4]["node_port_networks"]["cidrs"]
    finally:
        assert stop(proc) == 0, log.read_text()
    assert "stopped at revision" in log.read_text()


def test_userspace_proxy_carries_tcp_to_a_cluster_ip(
    env: AgentEnv, socket_path: Path, agent_ns: str
) -> None:
    env.kube.apply(
        service("echo", agent_ns, [service_port("tcp", 80, BACKEND_PORT, "TCP")]),
        endpoint_slice(
            "echo-1", agent_ns, "echo", env.backend_endpoints(4), [("tcp", BACKEND_PORT, "TCP")]
        ),
    )
    svc = Svc(env.kube.get("service", "echo", agent_ns))
    # The cluster IP is delivered to n1's own stack, where the proxy listens (IP_FREEBIND).
    env.topology.exec(env.n1, ["ip", "route", "add", "local", f"{svc.ip()}/32", "dev", "lo"])
    log = env.topology.tmpdir / "userspace-proxy.log"
    proc = plugin(
        env,
        [
            str(PLUGINS / "userspace-proxy" / "userspace_proxy.py"),
            "--target",
            f"unix://{socket_path}",
        ],
        log,
        in_node=True,
    )
    try:
        wait_until(
            lambda: f"proxying {svc.ip()}:80" in log.read_text(),
            10,
            message=lambda: log.read_text(),
        )
        result = env.probe(svc.ip(), 80, "tcp", count=20)
        assert result.answered == 20, (result, log.read_text())
        assert result.backends == {"b1", "b2"}
    finally:
        stop(proc)
        env.topology.exec(env.n1, ["ip", "route", "del", "local", f"{svc.ip()}/32", "dev", "lo"])
