"""The node simulator's runc runtime: pods run from the images `make image` built.

A simulated node with `runtime="runc"` runs a pod's container from its image under runc: the
securityContext enforced (non-root, read-only root, capabilities), volumes bind-mounted at their
mountPaths, the node's netns for hostNetwork pods and the pod's own otherwise. An image that was
not built cannot be pulled: ErrImagePull, then ImagePullBackOff, as a kubelet reports it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from kpx_cluster import images, oci
from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Node, Topology
from kpx_cluster.nodesim import NodeSimulator
from kpx_cluster.nodesim.runc import built_images
from kpx_kube import NotFound, from_kubeconfig
from kpx_kube.blocking import BlockingClient

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

T = TypeVar("T")
Obj = dict[str, Any]
OPERATOR, AGENT = images.images(images.project_version())


def wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class Env:
    cluster: Cluster
    topo: Topology
    sim: NodeSimulator
    node: Node
    ns: str
    client: BlockingClient

    def pod(self, name: str) -> Obj | None:
        try:
            return self.client.get(f"/api/v1/namespaces/{self.ns}/pods/{name}")
        except NotFound:
            return None

    def waiting_reason(self, name: str) -> str | None:
        pod = self.pod(name) or {}
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            return str((status.get("state") or {}).get("waiting", {}).get("reason") or "")
        return None

    def apply(self, *objs: Obj) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))

    def log(self, name: str, container: str = "c") -> str:
        found = self.sim.pod(self.ns, name)
        path = found.logs.get(container) if found is not None else None
        return path.read_text() if path is not None and path.exists() else ""


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[Env]:
    run = secrets.token_hex(3)
    ns = f"runc-{run}"
    with Topology() as topo:
        try:
            store = built_images()
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        sim = NodeSimulator(cluster, topo, runtime="runc", images=store)
        try:
            node = sim.add_node(f"runc-{run}", labels={"nodesim.kpx.test/run": run})
            cluster.create_namespace(ns)
            yield Env(
                cluster, topo, sim, node, ns, BlockingClient(from_kubeconfig(cluster.kubeconfig))
            )
        finally:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
            sim.stop(delete_nodes=True)


def _pod(env: Env, name: str, container: Obj, **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": env.ns},
        "spec": {
            "nodeName": env.node.name,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", **container}],
            **spec,
        },
    }


def test_an_image_that_was_not_built_cannot_be_pulled(env: Env) -> None:
    env.apply(_pod(env, "nope", {"image": "ghcr.io/kpx/kpx-agent:0.0.0-missing"}))
    seen: list[str] = []

    def reasons() -> list[str] | None:
        reason = env.waiting_reason("nope")
        if reason and (not seen or seen[-1] != reason):
            seen.append(reason)
        return seen if "ImagePullBackOff" in seen else None

    wait_until(reasons, 30, "ErrImagePull then ImagePullBackOff")
    assert seen.index("ErrImagePull") < seen.index("ImagePullBackOff"), seen
    pod = env.pod("nope") or {}
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert "0.0.0-missing" in waiting["message"]
    assert pod["status"]["phase"] == "Pending"
    assert env.sim.pod_processes(env.ns, "nope") == []


#: Prints what the container sees, then stays up (so its log can be read while it runs).
PROBE = """
import os, time
print("uid", os.getuid(), flush=True)
try:
    open("/etc/kpx-write-test", "w")
    print("root writable", flush=True)
except OSError as err:
    print("root", err.strerror, flush=True)
print("config", open("/etc/kpx/config/key").read(), flush=True)
print("netns", os.stat("/proc/self/ns/net").st_ino, flush=True)
print("done", flush=True)
time.sleep(600)
"""


def test_the_operator_image_runs_non_root_on_a_read_only_root_with_its_volumes(env: Env) -> None:
    # The securityContext of operator/manifests/deployment.yaml.
    env.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg", "namespace": env.ns},
            "data": {"key": "from-configmap"},
        },
        _pod(
            env,
            "op",
            {
                "image": OPERATOR.ref,
                "command": ["python3", "-c", PROBE],
                "volumeMounts": [{"name": "cfg", "mountPath": "/etc/kpx/config"}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            },
            securityContext={
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}],
        ),
    )
    out = wait_until(lambda: "done" in (log := env.log("op")) and log, 60, "the probe's output")
    assert "uid 65532" in out
    assert "root Read-only file system" in out
    assert "config from-configmap" in out
    sim_pod = env.sim.pod(env.ns, "op")
    assert sim_pod is not None
    own_netns = os.stat(f"/run/netns/{sim_pod.netns}").st_ino
    assert f"netns {own_netns}" in out
    assert sim_pod.netns != env.node.netns
    status = (env.pod("op") or {})["status"]["containerStatuses"][0]
    assert "running" in status["state"]
    assert status["containerID"].startswith("runc://")
    runc = env.sim.runc
    assert runc is not None
    digest = oci.archive_refs(runc.store.refs[OPERATOR.ref])[OPERATOR.ref]
    assert status["imageID"].endswith("@" + digest)


#: What the agent does to a node's kernel, in miniature: make an nftables table.
NFT = "nft add table ip {table} && echo programmed || echo refused; sleep 600"


@pytest.mark.parametrize("caps", [["NET_ADMIN"], []], ids=["net-admin", "no-caps"])
def test_the_agent_image_on_the_host_network_needs_net_admin(env: Env, caps: list[str]) -> None:
    name = f"nft-{'admin' if caps else 'none'}"
    table = f"kpx_runc_{secrets.token_hex(2)}"
    env.apply(
        _pod(
            env,
            name,
            {
                "image": AGENT.ref,
                "command": ["sh", "-c", NFT.format(table=table)],
                "securityContext": {"capabilities": {"drop": ["ALL"], "add": caps}},
            },
            hostNetwork=True,
        )
    )
    out = wait_until(lambda: env.log(name).strip(), 60, "the nft attempt")
    tables = env.topo.exec(env.node, ["nft", "list", "tables"]).stdout
    if caps:
        assert "programmed" in out
        assert table in tables  # in the node's netns: hostNetwork is the node's network
    else:
        assert "Operation not permitted" in out and "refused" in out
        assert table not in tables
    env.cluster.kubectl("-n", env.ns, "delete", "pod", name, "--wait=true", "--timeout=30s")
    assert env.sim.pod(env.ns, name) is None
