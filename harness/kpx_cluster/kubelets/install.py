"""A service proxy installed on a `RealCluster` as users install it, from the images the nodes
imported (never pulled):

- `install_kpx(rc, mode)`: the CRD, the operator's shipped manifests (operator/manifests, its
  Deployment from the project's image) and examples/proxyconfig.yaml in `mode`; the operator
  then makes the agents' DaemonSet. The operator is pointed at the apiserver's real address:
  no proxy answers the `kubernetes` Service before the agents run.
- `install_kube_proxy(rc, mode)`: upstream kube-proxy as kubeadm deploys it (its DaemonSet in
  kube-system, `upstream_kube_proxy`), the baseline.

Both wait until the proxy runs on every node (`wait_*`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import yaml

from .. import images, upstream_kube_proxy
from ..controlplane import Cluster
from .cluster import RealCluster

REPO: Final = Path(__file__).resolve().parents[3]
KPX_NAMESPACE: Final = "kpx-system"
#: the harness's pod CIDRs (10.244.<i>.0/24, fd00:244:<i>::/64 per node)
CLUSTER_CIDRS: Final = ("10.244.0.0/16", "fd00:244::/48")
PROXIES: Final = ("kpx", "kube-proxy")
T = TypeVar("T")


class Nodes(Protocol):
    """A control plane with real nodes (a `RealCluster`, or the demo's view of one that another
    process owns)."""

    @property
    def cluster(self) -> Cluster: ...

    @property
    def node_count(self) -> int: ...


class InstallFailed(RuntimeError):
    """The proxy did not come up on every node in time."""


def wait_until(check: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise InstallFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def get(rc: Nodes, *args: str) -> dict[str, Any]:
    out = rc.cluster.kubectl("get", *args, "-o", "json", check=False)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else {}


def archives(proxy: str) -> list[Path]:
    """The OCI archives the nodes import for `proxy` (built by `make image`)."""
    directory = images.archives_dir()
    if proxy == "kpx":
        if images.missing(directory=directory):
            raise InstallFailed("the kpx images are missing or stale: run `make image`")
        return [i.archive(directory) for i in images.images(images.project_version())]
    if proxy == "kube-proxy":
        if images.kube_proxy_missing(directory=directory):
            raise InstallFailed("the kube-proxy image is missing or stale: run `make image`")
        return [images.kube_proxy_image().archive(directory)]
    raise ValueError(f"proxy {proxy!r}: one of {', '.join(PROXIES)}")


def _apply(rc: Nodes, items: list[dict[str, Any]]) -> None:
    rc.cluster.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )


def install_kpx(
    rc: Nodes, mode: str, pxc: dict[str, Any] | None = None, timeout: float = 240
) -> dict[str, Any]:
    """kpx in `mode` with `pxc` (default examples/proxyconfig.yaml with conntrack.maxPerCore
    0: the nodes share this machine's kernel, whose table size is global, as kind's do); the
    harness's cluster CIDRs replace the example's. Returns the ProxyConfiguration's status once
    Ready on every node."""
    rc.cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    wait_until(lambda: crds_established(rc), 60, "the CRDs Established")
    _apply(rc, operator_manifests(rc.cluster))
    example = pxc or yaml.safe_load((REPO / "examples" / "proxyconfig.yaml").read_text())
    if pxc is None:
        example["spec"].setdefault("conntrack", {})["maxPerCore"] = 0
    example["spec"]["clusterCIDRs"] = list(CLUSTER_CIDRS)
    example["spec"]["mode"] = mode
    if mode == "ipvs":  # deprecated upstream: kpx runs it only when acknowledged
        example["spec"].setdefault("ipvs", {})["acknowledgeDeprecation"] = True
    for other in ("nftables", "iptables", "ipvs", "external"):  # one block per mode: the mode's
        if other != mode:
            example["spec"].pop(other, None)
    _apply(rc, [example])
    return wait_kpx(rc, mode, timeout)


def apiserver_endpoint(cluster: Cluster) -> str:
    """host:port of the apiserver as the nodes reach it (no Service VIP)."""
    return cluster.cluster_server.removeprefix("https://")


def operator_manifests(cluster: Cluster) -> list[dict[str, Any]]:
    """operator/manifests as kustomize renders them, the operator pointed at the apiserver's
    real address (its env and --apiserver-endpoint, which it hands the agents): with no
    kube-proxy, nothing answers the `kubernetes` Service VIP until kpx runs."""
    endpoint = apiserver_endpoint(cluster)
    host, port = endpoint.rsplit(":", 1)
    manifests = cluster.kubectl("kustomize", str(REPO / "operator" / "manifests")).stdout
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "kpx-operator":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["env"] += [
                {"name": "KUBERNETES_SERVICE_HOST", "value": host},
                {"name": "KUBERNETES_SERVICE_PORT", "value": port},
            ]
            container["command"] += ["--apiserver-endpoint", endpoint]
    return docs


def crds_established(rc: Nodes) -> bool:
    """Every CRD of crds/ Established (`kubectl wait` fails outright on a CRD that has no
    status yet, right after it is created)."""
    names = [
        doc["metadata"]["name"]
        for path in sorted((REPO / "crds").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "CustomResourceDefinition"
    ]
    for name in names:
        conditions = get(rc, "crd", name).get("status", {}).get("conditions", [])
        if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return False
    return True


def kpx_ready(rc: Nodes, mode: str) -> dict[str, Any] | None:
    status = get(rc, "pxc", "default").get("status", {})
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
    )
    done = ready and status.get("mode") == mode and status.get("readyNodes") == rc.node_count
    return dict(status) if done else None


def wait_kpx(rc: Nodes, mode: str, timeout: float = 240) -> dict[str, Any]:
    return wait_until(
        lambda: kpx_ready(rc, mode), timeout, f"ProxyConfiguration Ready in {mode} on every node"
    )


def install_kube_proxy(rc: Nodes, mode: str, timeout: float = 180) -> None:
    """Upstream kube-proxy's DaemonSet in `mode` on every node."""
    objects = upstream_kube_proxy.objects(
        mode,
        0,
        {},
        cluster_cidr=",".join(CLUSTER_CIDRS),
        server=rc.cluster.cluster_server,
        conntrack_timeouts=True,  # each real node is a network namespace of its own
    )
    _apply(rc, objects)
    rc.cluster.kubectl(
        "-n",
        upstream_kube_proxy.NAMESPACE,
        "rollout",
        "status",
        f"daemonset/{upstream_kube_proxy.NAME}",
        f"--timeout={timeout:.0f}s",
        timeout=timeout + 10,
    )


def install(rc: Nodes, proxy: str, mode: str) -> None:
    if proxy == "kpx":
        install_kpx(rc, mode)
    elif proxy == "kube-proxy":
        install_kube_proxy(rc, mode)
    else:
        raise ValueError(f"proxy {proxy!r}: one of {', '.join(PROXIES)}")


@contextlib.contextmanager
def nodes_for(
    proxy: str | tuple[str, ...], name: str, nodes: int, timeout: float = 180
) -> Iterator[RealCluster]:
    """A RealCluster of `nodes` nodes that imported the images of `proxy` (one or several;
    InstallFailed when they are missing or stale); down on exit, which must leave nothing
    behind."""
    proxies = (proxy,) if isinstance(proxy, str) else proxy
    rc = RealCluster(name, nodes=nodes, archives=[a for p in proxies for a in archives(p)])
    rc.up(timeout=timeout)
    try:
        yield rc
    finally:
        left = rc.down()
        if left:
            raise AssertionError(f"{name}: down left {left}")
