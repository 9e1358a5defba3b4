"""The migration harness on real kubelets (issue #23): `real_migration_cluster(mode)` gives the
same `MigrationEnv` as `migration.migration_cluster` gives on the node simulator, so
`switch`, `preflight_load`, `switch_with_rollback` and `revert_while_stuck` run unchanged;
`real_kube_proxy_cluster(mode)` is `migration_takeover.kube_proxy_cluster`'s (upstream
kube-proxy's DaemonSet from its image on the kubelets), for `take_over`.

What differs from the simulator:
- the nodes are a `RealCluster`'s (a kubelet and containerd each, kube-proxy absent), which
  imported the project's images; kpx is installed as `kubelets.install` installs it (the
  operator's manifests, its Deployment from the image), with the migration's
  ProxyConfiguration (`maxUnavailable: 1`, its nodes labelled);
- the backends run the harness's `echo_server` and `migration_load hold-server` as real pods:
  the agent image's Python (the image has no harness) runs the two files from a ConfigMap;
- each node's load client is a network namespace on the node's bridge cbr0 with an address
  the CNI never hands out (`kubelets.config.HARNESS_POD_HOSTS_FROM`), a pod in everything but
  name: its traffic to ClusterIPs and NodePorts crosses the node's rules as a pod's does.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import images
from .kubelets import install
from .kubelets.cluster import RealCluster
from .migration import (
    MigrationEnv,
    app_objects,
    proxy_configuration,
    wait_backends_ready,
    wait_until,
)
from .migration_takeover import kube_proxy_pods, serves

HARNESS = Path(__file__).resolve().parent
#: the harness's modules the backends run (standard library only)
SCRIPTS = ("echo_server.py", "migration_load.py")
# The backends request CPU, as a production app does. Without a request a pod is BestEffort:
# its cgroup weighs 2 against the agent's 51 (cpu 50m), so on this 2-core machine, which runs
# three nodes and their control plane, the agents' start (tens of CPU-bound seconds) starves the
# echo servers, and the clients then time out on every target at once. Two full `make test` runs
# saw exactly that pattern in the takeover under load (every node, every target, one ~1 s window
# while the agents started); the test alone, even beside two CPU hogs, never did.
BACKEND_REQUESTS = {"cpu": "100m", "memory": "32Mi"}
SCRIPT_DIR = "/opt/kpx-load"
PXC = "default"  # kubelets.install reads the ProxyConfiguration of this name


def agent_image() -> str:
    agent, _operator = images.images(images.project_version())
    return agent.ref


def scripts_config_map(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "load-scripts", "namespace": ns},
        "data": {name: (HARNESS / name).read_text() for name in SCRIPTS},
    }


def on_real_nodes(obj: dict[str, Any], image: str) -> dict[str, Any]:
    """The simulator's backend Deployment for real kubelets: every container runs its
    `python3 -m kpx_cluster.<module>` as `python3 SCRIPT_DIR/<module>.py` in `image`, from
    the ConfigMap `load-scripts`, and requests CPU (`BACKEND_REQUESTS`); Services pass
    unchanged."""
    if obj["kind"] != "Deployment":
        return obj
    spec = obj["spec"]["template"]["spec"]
    for container in spec["containers"]:
        argv = container["command"]
        if argv[:2] != ["python3", "-m"] or not argv[2].startswith("kpx_cluster."):
            raise ValueError(f"container {container['name']}: not a harness module: {argv}")
        module = argv[2].removeprefix("kpx_cluster.")
        container["command"] = ["python3", f"{SCRIPT_DIR}/{module}.py", *argv[3:]]
        container["image"] = image
        container["imagePullPolicy"] = "Never"
        container["volumeMounts"] = [{"name": "scripts", "mountPath": SCRIPT_DIR}]
        container["resources"] = {"requests": dict(BACKEND_REQUESTS)}
    spec["volumes"] = [{"name": "scripts", "configMap": {"name": "load-scripts"}}]
    spec["terminationGracePeriodSeconds"] = 1
    return obj


def _app_and_clients(rc: RealCluster, label: dict[str, str], pxc: str, nodes: int) -> MigrationEnv:
    """The backends (real pods), the Services and a client netns per node."""
    topo = rc.topology
    assert topo is not None
    app_ns = f"kpx-migration-{next(iter(label.values()))}"
    rc.cluster.create_namespace(app_ns)
    image = agent_image()
    objs = [scripts_config_map(app_ns)]
    objs += [on_real_nodes(o, image) for o in app_objects(app_ns, label, nodes)]
    for obj in objs:
        rc.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))
    real_nodes = [topo.nodes[name] for name in rc.node_names]
    clients = [topo.add_pod(node, f"load-{i}") for i, node in enumerate(real_nodes)]
    return MigrationEnv(rc.cluster, topo, None, real_nodes, clients, pxc, app_ns, label)


def _label_nodes(rc: RealCluster, label: dict[str, str]) -> None:
    for key, value in label.items():
        rc.cluster.kubectl("label", "node", "--all", f"{key}={value}")


@contextlib.contextmanager
def real_kube_proxy_cluster(
    kube_proxy_mode: str, nodes: int = 3, log: Callable[[str], None] = print
) -> Iterator[MigrationEnv]:
    """`nodes` real nodes served by upstream kube-proxy in `kube_proxy_mode`, the app and a
    client netns per node; kpx's images are on the nodes, kpx is not installed (`take_over`
    does)."""
    label = {"kpx.dev/e2e-takeover": secrets.token_hex(3)}
    with install.nodes_for(("kpx", "kube-proxy"), f"kpx-tko-{os.getpid()}", nodes) as rc:
        _label_nodes(rc, label)
        log(f"installing kube-proxy ({kube_proxy_mode}) on {nodes} real nodes")
        install.install_kube_proxy(rc, kube_proxy_mode)
        env = _app_and_clients(rc, label, PXC, nodes)
        wait_until(
            lambda: list(kube_proxy_pods(env).values()) == [True] * nodes,
            120,
            "kube-proxy Ready on every node",
        )
        wait_backends_ready(env, nodes)
        wait_until(lambda: serves(env), 90, "kube-proxy serving every target")
        yield env


@contextlib.contextmanager
def real_migration_cluster(
    mode: str, nodes: int = 3, log: Callable[[str], None] = print
) -> Iterator[MigrationEnv]:
    """kpx in `mode` on `nodes` real nodes, the app, and a client netns per node."""
    label = {"kpx.dev/e2e-migration": secrets.token_hex(3)}
    with install.nodes_for("kpx", f"kpx-mig-{os.getpid()}", nodes) as rc:
        _label_nodes(rc, label)
        pxc = proxy_configuration(PXC, mode, label)
        # The nodes share this machine's kernel, whose conntrack table size is global.
        pxc["spec"].setdefault("conntrack", {})["maxPerCore"] = 0
        log(f"installing kpx ({mode}) on {nodes} real nodes")
        install.install_kpx(rc, mode, pxc=pxc)
        env = _app_and_clients(rc, label, PXC, nodes)
        wait_until(lambda: env.rolled_out(mode), 240, f"{PXC} Ready in {mode}")
        wait_backends_ready(env, nodes)
        # Ready backends are not yet programmed ones: the controller-manager writes their
        # EndpointSlices, then every agent syncs them.
        wait_until(lambda: serves(env), 90, f"kpx ({mode}) serving every target")
        yield env
