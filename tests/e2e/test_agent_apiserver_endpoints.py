"""An agent never needs a Service VIP to reach the apiserver (issue #22, "a node reboots in a
cluster without kube-proxy").

After a reboot the node's kernel has no rule for the `kubernetes` Service's IP, and nothing will
program one before the agent reached the apiserver. The operator hands the agents the
apiserver's own addresses (KPX_APISERVER_ENDPOINTS, from the `default/kubernetes`
EndpointSlice); in-cluster credentials try them before KUBERNETES_SERVICE_HOST. Here: an agent
with in-cluster credentials (a ServiceAccount token) on a node whose KUBERNETES_SERVICE_HOST is
a ClusterIP nothing answers starts, syncs and programs a new Service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import (
    AgentEnv,
    Svc,
    endpoint_slice,
    nft_ruleset,
    run_cleanup,
    service,
    service_port,
    start_agent,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

SA = "kpx-e2e-in-cluster"


@pytest.fixture
def service_account_dir(agent_env: AgentEnv, tmp_path: Path) -> Iterator[Path]:
    """ca.crt and a token of a ServiceAccount that may do what an agent does."""
    kubectl = agent_env.cluster.kubectl
    kubectl("-n", "default", "create", "serviceaccount", SA)
    kubectl(
        "create",
        "clusterrolebinding",
        SA,
        "--clusterrole=cluster-admin",
        f"--serviceaccount=default:{SA}",
    )
    try:
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        sa.joinpath("ca.crt").write_bytes(Path(agent_env.cluster.ca_file).read_bytes())
        token = kubectl("-n", "default", "create", "token", SA, "--duration=20m").stdout
        sa.joinpath("token").write_text(token.strip())
        yield sa
    finally:
        kubectl("delete", "clusterrolebinding", SA, "--ignore-not-found", check=False)
        kubectl("-n", "default", "delete", "serviceaccount", SA, "--ignore-not-found", check=False)


def test_an_agent_reaches_the_apiserver_without_the_kubernetes_service_vip(
    agent_env: AgentEnv, agent_ns: str, service_account_dir: Path
) -> None:
    kubernetes_vip = str(
        agent_env.kube.get("service", "kubernetes", "default")["spec"]["clusterIP"]
    )
    n2 = agent_env.n2
    assert kubernetes_vip not in nft_ruleset(agent_env.topology, n2), "n2 has rules already"
    env = {
        "KUBERNETES_SERVICE_HOST": kubernetes_vip,  # as the kubelet sets it: nothing answers
        "KUBERNETES_SERVICE_PORT": "443",
        # What the operator sets: the apiserver's own address (the topology relays it to
        # 127.0.0.1 inside every node).
        "KPX_APISERVER_ENDPOINTS": f"127.0.0.1:{agent_env.cluster.apiserver_port}",
        "KPX_SERVICEACCOUNT_DIR": str(service_account_dir),
    }
    agent = start_agent(
        agent_env.topology, n2, None, mode=agent_env.mode, config=agent_env.config, env_extra=env
    )
    try:
        ports = [service_port("http", 80, 8080)]
        agent_env.kube.apply(
            service("after-reboot", agent_ns, ports),
            endpoint_slice(
                "after-reboot-v4",
                agent_ns,
                "after-reboot",
                agent_env.backend_endpoints(),
                [("http", 8080, "TCP")],
            ),
        )
        svc = Svc(agent_env.kube.get("service", "after-reboot", agent_ns))
        wait_until(
            lambda: svc.ip() in nft_ruleset(agent_env.topology, n2),
            30,
            message=lambda: f"n2 never programmed {svc.ip()}:\n{agent.log_tail()}",
        )
        # It programmed the kubernetes Service too: from here on the VIP answers on n2.
        assert kubernetes_vip in nft_ruleset(agent_env.topology, n2)
    finally:
        agent.stop()
        run_cleanup(agent_env.topology, n2, agent_env.mode)
