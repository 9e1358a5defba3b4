"""Taking three simulated nodes over from upstream kube-proxy, under load (issue #18).

`kube_proxy_cluster(cluster, kube_proxy_mode)`: three simulated nodes served by upstream
kube-proxy (the image `make image` builds from the pinned binary, run under runc by the node
simulator as the kube-system/kube-proxy DaemonSet: `kpx_cluster.upstream_kube_proxy`) in
`kube_proxy_mode`, the backends, Services and load clients of `kpx_cluster.migration`, and no
kpx yet. `take_over(env)` starts the same load, installs kpx as a user would (the CRDs, the
operator's manifests, the operator and the agents from the images under runc) with a
ProxyConfiguration in mode nftables and `takeover: {fromKubeProxy: true, moveKubeProxyOff:
true}`, waits until every node runs a Ready agent, no node runs kube-proxy's Pod,
status.takeover says KubeProxyRulesRemoved for every node and no node has a rule or table of
kube-proxy's (`kube_proxy_rules`), stops the load and returns a `migration.SwitchResult`
("kube-proxy iptables -> nftables": a row of `make bench-migration`'s table).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import upstream_kube_proxy
from .controlplane import Cluster
from .kubelets import install as kubelets_install
from .migration import (
    LoadOptions,
    MigrationEnv,
    SwitchResult,
    _app,
    _apply,
    _start_load,
    _stop_load,
    apply_kpx,
    explained,
    preflight_load,
    proxy_configuration,
    remove_kpx,
    wait_backends_ready,
    wait_until,
)
from .netns import Node, Topology
from .nodesim import NodeSimulator
from .nodesim.runc import built_images

#: The kubelet's KUBE-* chains: they stay. Every other KUBE-* chain counts as kube-proxy's (an
#: oracle of its own, broader than the agent's list in kpx_agent/handover/kube_proxy_leftovers.py).
KUBELET_CHAINS = frozenset(
    {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-MARK-DROP"}
)
NFT_TABLES = ("ip kube-proxy", "ip6 kube-proxy")
SAVE_TOOLS = (
    "iptables-nft-save",
    "ip6tables-nft-save",
    "iptables-legacy-save",
    "ip6tables-legacy-save",
)


def owned(chain: str) -> bool:
    return chain.startswith("KUBE-") and chain not in KUBELET_CHAINS


def iptables_rules_of_kube_proxy(save_text: str) -> list[str]:
    """Pure: the lines of an `iptables-save` output that are kube-proxy's: a KUBE-* chain but
    the kubelet's (`KUBELET_CHAINS`), a rule in one, or a rule jumping to one."""
    found = []
    for raw in save_text.splitlines():
        line = raw.strip()
        words = line.split()
        if line.startswith(":") and owned(line[1:].split()[0]):
            found.append(line)
        elif line.startswith("-A ") and len(words) > 1:
            target = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-j", "-g")), "")
            if owned(words[1]) or owned(target):
                found.append(line)
    return found


def kube_proxy_rules(topo: Topology, node: Node) -> list[str]:
    """kube-proxy's chains and rules (both families, nf_tables and legacy) and its nftables
    tables in `node`'s netns."""
    found: list[str] = []
    for tool in SAVE_TOOLS:
        out = topo.exec(node, [tool], check=False).stdout
        found += [f"{tool}: {line}" for line in iptables_rules_of_kube_proxy(out)]
    tables = topo.exec(node, ["nft", "list", "tables"], check=True).stdout
    present = {line.removeprefix("table ").strip() for line in tables.splitlines()}
    found += [f"nft table {t}" for t in NFT_TABLES if t in present]
    return found


def kube_proxy_pods(env: MigrationEnv) -> dict[str, bool]:
    """node -> whether its kube-proxy Pod is Ready, for the pods on `env`'s nodes."""
    pods = env.json("-n", upstream_kube_proxy.NAMESPACE, "get", "pods", "-l", "k8s-app=kube-proxy")
    mine = {n.name for n in env.nodes}
    out = {}
    for pod in pods.get("items", []):
        node = pod["spec"].get("nodeName")
        if node in mine:
            conditions = pod.get("status", {}).get("conditions", [])
            out[node] = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return out


def takeover_phases(env: MigrationEnv) -> dict[str, str]:
    """node -> its phase in the ProxyConfiguration's status.takeover."""
    status = env.json("get", "pxc", env.pxc).get("status", {})
    return {n["name"]: n["phase"] for n in (status.get("takeover") or {}).get("nodes") or []}


def kube_proxy_leftovers(env: MigrationEnv) -> dict[str, list[str]]:
    out = {}
    for node in env.nodes:
        found = kube_proxy_rules(env.topo, node)
        if found:
            out[node.name] = found
    return out


def _delete_kube_proxy(cluster: Cluster) -> None:
    ns = upstream_kube_proxy.NAMESPACE
    for kind in ("daemonset", "configmap", "serviceaccount"):
        cluster.kubectl(
            "-n",
            ns,
            "delete",
            kind,
            upstream_kube_proxy.NAME,
            "--ignore-not-found",
            check=False,
            timeout=60,
        )
    cluster.kubectl(
        "delete",
        "clusterrolebinding",
        "kubeadm:node-proxier",
        "--ignore-not-found",
        check=False,
        timeout=60,
    )


@contextlib.contextmanager
def kube_proxy_cluster(
    cluster: Cluster, kube_proxy_mode: str, nodes: int = 3, log: Callable[[str], None] = print
) -> Iterator[MigrationEnv]:
    """`nodes` simulated nodes served by upstream kube-proxy in `kube_proxy_mode`, the app and
    a client pod netns per node; kpx is not installed (`take_over` does)."""
    run = secrets.token_hex(3)
    label = {"kpx.dev/e2e-takeover": run}
    pxc, app_ns = f"takeover-{run}", f"kpx-takeover-{run}"
    store = built_images()
    if upstream_kube_proxy.IMAGE not in store.refs:
        raise RuntimeError(f"{upstream_kube_proxy.IMAGE} is not built: run `make image`")
    with Topology() as topo:
        sim = NodeSimulator(cluster, topo, pod_apiserver_access=True, runtime="runc", images=store)
        try:
            sim_nodes = [sim.add_node(f"t{run}-{i}", labels=label) for i in range(1, nodes + 1)]
            _delete_kube_proxy(cluster)  # a former run's
            for obj in upstream_kube_proxy.objects(kube_proxy_mode, sim.apiserver_port, label):
                _apply(cluster, obj)
            _app(cluster, app_ns, label, nodes)
            clients = [topo.add_pod(node, f"load-{i}") for i, node in enumerate(sim_nodes)]
            env = MigrationEnv(cluster, topo, sim, sim_nodes, clients, pxc, app_ns, label)
            log(f"waiting for kube-proxy ({kube_proxy_mode}) on {nodes} nodes and the backends")
            wait_until(
                lambda: list(kube_proxy_pods(env).values()) == [True] * nodes,
                120,
                "kube-proxy Ready on every node",
            )
            wait_backends_ready(env, nodes)
            wait_until(lambda: serves(env), 90, "kube-proxy serving every target")
            yield env
        finally:
            remove_kpx(cluster, pxc, app_ns)
            _delete_kube_proxy(cluster)
            sim.stop(delete_nodes=True)


def serves(env: MigrationEnv) -> bool:
    """A second of the load answers every try, from every node (kube-proxy has synced the
    Services and their endpoints everywhere)."""
    return all(
        s.tcp.failed == 0 and s.udp.failed == 0 and s.held_survived == len(s.held)
        for s in preflight_load(env, seconds=1.0)
    )


def install_kpx(env: MigrationEnv, mode: str = "nftables") -> None:
    """The CRDs, the operator's manifests (its Deployment on `env`'s nodes) and the
    ProxyConfiguration in `mode` taking the nodes over from kube-proxy and moving it off."""
    pxc: dict[str, Any] = proxy_configuration(env.pxc, mode, env.label)
    pxc["spec"]["takeover"] = {"fromKubeProxy": True, "moveKubeProxyOff": True}
    if env.real_nodes:  # as kubelets.install installs kpx
        pxc["spec"]["clusterCIDRs"] = list(kubelets_install.CLUSTER_CIDRS)
        pxc["spec"].setdefault("conntrack", {})["maxPerCore"] = 0
    apply_kpx(env.cluster, env.label, pxc, real_nodes=env.real_nodes)


def take_over(
    env: MigrationEnv,
    kube_proxy_mode: str,
    opts: LoadOptions | None = None,
    timeout: float = 300,
    log: Callable[[str], None] = print,
) -> SwitchResult:
    """Under load: install kpx (nftables, takeover), wait until it serves every node with
    kube-proxy and its rules gone; the load's figures and what of kube-proxy's is left."""
    opts = opts or LoadOptions()
    old = f"kube-proxy {kube_proxy_mode}"
    return explained(env, log, lambda: _take_over(env, old, opts, timeout, log))


def _take_over(
    env: MigrationEnv,
    old: str,
    opts: LoadOptions,
    timeout: float,
    log: Callable[[str], None],
) -> SwitchResult:
    started = _start_load(env, opts)
    node_ready: dict[str, float] = {}
    duration = 0.0
    try:
        time.sleep(opts.warmup)
        t0 = time.monotonic()
        log("installing kpx: nftables, takeover.fromKubeProxy and moveKubeProxyOff")
        install_kpx(env)

        def done() -> bool:
            for pod in env.agent_pods():
                node = pod["spec"]["nodeName"]
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in pod.get("status", {}).get("conditions", [])
                )
                if ready and node not in node_ready:
                    node_ready[node] = round(time.monotonic() - t0, 1)
                    log(f"  {node}: agent Ready after {node_ready[node]}s")
            taken = dict.fromkeys((n.name for n in env.nodes), "KubeProxyRulesRemoved")
            return bool(
                env.rolled_out("nftables")
                and not kube_proxy_pods(env)
                and takeover_phases(env) == taken
                and not kube_proxy_leftovers(env)
            )

        try:
            wait_until(done, timeout, "kpx on every node, kube-proxy and its rules gone")
        except TimeoutError as err:
            raise TimeoutError(f"{err}; status.takeover: {takeover_phases(env)}") from err
        duration = time.monotonic() - t0
        log(f"taken over in {duration:.1f}s")
        time.sleep(opts.settle)
    finally:
        loads = _stop_load(started, opts.timeout)
    return SwitchResult(
        old,
        "nftables",
        len(env.nodes),
        round(duration, 1),
        loads,
        kube_proxy_leftovers(env),
        node_ready,
    )
