"""examples/proxyconfig-ipvs.yaml deploys agents that proxy traffic: the agent the operator's
rendering of that example describes, run in a node netns of a kernel with IPVS, against the
local control plane.

tests/e2e/test_ipvs_in_vm.py (on the host) renders the example with the operator's builders
(ConfigMap and DaemonSet), gives the agents' ServiceAccount the installed RBAC and a token, and
runs this test in a `proxy-vm` guest with KPX_IPVS_EXAMPLE_DIR naming what it wrote. The node
simulator does not run in the guest (an emulated kubelet, runc and images would take minutes):
this test is the kubelet for one pod of the DaemonSet. It runs the agent container's command,
with the ConfigMap's files and its hostPath volumes (the node's paths, in the node's netns)
where the container's arguments name their mount paths, and its environment (fieldRefs
resolved as a kubelet does); the token and CA a kubelet would mount at the standard
service-account path are in KPX_SERVICEACCOUNT_DIR. Anything else in the container (another
volume kind, another env source) fails the test instead of being skipped over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from agent_harness import node_addresses, node_object
from test_ipvs_kernel import pytestmark  # noqa: F401  (skipped where no IPVS)

from kpx_cluster.netns import Node, Topology
from kpx_cluster.probe import probe

AGENT_CONTAINER = "agent"


def kubectl(*args: str, input: str | None = None) -> str:
    done = subprocess.run(
        ["kubectl", *args], input=input, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def container_argv(container: dict[str, Any], pod: dict[str, Any], work: Path) -> list[str]:
    """The container's command, with the paths it mounts mapped to where they are here."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mapped: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            mapped[mount["mountPath"]] = str(work / "configmaps" / volume["configMap"]["name"])
        elif "hostPath" in volume:  # the node's path (a kubelet bind-mounts it there)
            mapped[mount["mountPath"]] = volume["hostPath"]["path"]
        else:
            raise AssertionError(f"volume kind not run by this test: {volume}")
    command = [*container["command"], *container.get("args", [])]
    assert command[0] == "proxy-agent", command
    argv = [sys.executable, "-m", "kpx_agent.cli"]
    for arg in command[1:]:
        for mount_path, here in mapped.items():
            if arg == mount_path or arg.startswith(mount_path + "/"):
                arg = here + arg[len(mount_path) :]
        argv.append(arg)
    return argv


def container_env(container: dict[str, Any], node: str, namespace: str) -> dict[str, str]:
    fields = {
        "spec.nodeName": node,
        "metadata.name": f"kpx-agent-{node}",
        "metadata.namespace": namespace,
        "metadata.uid": str(uuid.uuid4()),
    }
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def wait_for(what: str, check: Any, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout}s; agent log:\n{log.read_text()[-4000:]}")


def test_the_rendered_ipvs_example_proxies_a_cluster_ip_and_a_node_port(
    topology: Topology,
) -> None:
    if "KPX_IPVS_EXAMPLE_DIR" not in os.environ:
        pytest.skip("run by tests/e2e/test_ipvs_in_vm.py, which renders the example")
    work = Path(os.environ["KPX_IPVS_EXAMPLE_DIR"])
    daemonset = json.loads((work / "daemonset.json").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == AGENT_CONTAINER]
    n1, n2 = topology.add_node("x1"), topology.add_node("x2")
    b1, b2 = topology.add_pod(n1, "b1"), topology.add_pod(n2, "b2")
    client, other = topology.add_pod(n1, "client"), topology.add_pod(n2, "other")
    for backend in (b1, b2):
        topology.run_ready(
            backend,
            topology.python_argv(
                "kpx_cluster.echo_server", "--name", backend.name, "--port", "8080"
            ),
        )
    # The agents reach the apiserver where the DaemonSet's environment says (the host's
    # loopback, relayed into the guest by proxy-vm and into the node by the topology).
    agent_env = container_env(container, n1.name, daemonset["metadata"]["namespace"])
    topology.expose_host_port(int(agent_env["KUBERNETES_SERVICE_PORT"]))
    ns = f"ipvs-example-{uuid.uuid4().hex[:6]}"
    selector = pod.get("nodeSelector", {})
    nodes: list[Node] = [n1, n2]
    try:
        # One kubectl run for the objects, one per node status: each run of the Go binary
        # costs seconds under the guest's emulated CPU.
        objects: list[dict[str, Any]] = []
        for node in nodes:
            obj = node_object(node)
            if node is n1:  # the node the DaemonSet selects
                obj["metadata"]["labels"].update(selector)
            objects.append(obj)
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web", "namespace": ns},
                "spec": {
                    "type": "NodePort",
                    "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
                },
            }
        )
        objects.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "web-1",
                    "namespace": ns,
                    "labels": {"kubernetes.io/service-name": "web"},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [
                    {"addresses": [b1.ipv4], "nodeName": n1.name, "conditions": {"ready": True}},
                    {"addresses": [b2.ipv4], "nodeName": n2.name, "conditions": {"ready": True}},
                ],
            }
        )
        applied = json.loads(
            kubectl(
                "apply",
                "-o",
                "json",
                "-f",
                "-",
                input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
            )
        )
        [created] = [o for o in applied["items"] if o["kind"] == "Service"]
        vip = created["spec"]["clusterIP"]
        node_port = created["spec"]["ports"][0]["nodePort"]
        for node in nodes:
            kubectl(
                "patch",
                "node",
                node.name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps(node_addresses(node)),
            )

        env = {**os.environ, **agent_env, "KPX_SERVICEACCOUNT_DIR": str(work / "serviceaccount")}
        env.pop("KUBECONFIG", None)  # the pod's own credentials only
        log = topology.tmpdir / "agent.log"
        with log.open("wb") as out:
            argv = container_argv(container, pod, work)
            agent = topology.run(
                n1, argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

        def programmed() -> bool:
            if agent.poll() is not None:
                raise AssertionError(f"agent exited {agent.returncode}:\n{log.read_text()}")
            listing = topology.exec(n1, ["ipvsadm", "-Ln"]).stdout
            return f"{vip}:80 wrr" in listing and b2.ipv4 in listing

        wait_for("the example's virtual servers", programmed, 180, log)
        # The example's spec.ipvs, in the kernel: timeouts and strictARP.
        timeouts = topology.exec(n1, ["ipvsadm", "-Ln", "--timeout"]).stdout.split()[-3:]
        assert timeouts == ["900", "120", "300"], timeouts
        arp = topology.exec(
            n1, ["sysctl", "-n", "net.ipv4.conf.all.arp_ignore", "net.ipv4.conf.all.arp_announce"]
        ).stdout.split()
        assert arp == ["1", "2"]
        assert "deprecated" in log.read_text()
        # A pod on the node reaches both endpoints through the ClusterIP; a pod on the other
        # node reaches them through the NodePort on the node's address.
        through_vip = probe(topology, client, vip, 80, "tcp", count=10, timeout=2)
        assert through_vip.backends == {"b1", "b2"} and through_vip.failed == 0, through_vip
        through_node_port = probe(topology, other, n1.ipv4, node_port, "tcp", count=6, timeout=2)
        assert through_node_port.answered == 6, through_node_port
        assert through_node_port.backends <= {"b1", "b2"}, through_node_port
    finally:
        subprocess.run(
            [
                "kubectl",
                "delete",
                f"namespace/{ns}",
                *(f"node/{node.name}" for node in nodes),
                "--wait=false",
                "--ignore-not-found",
            ],
            capture_output=True,
            check=False,
        )
