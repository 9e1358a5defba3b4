"""Mode switches under constant load on a three-node simulated cluster (issue #18).

    python3 bench/migration.py [--nodes 3] [--interval 0.015] [--holds 2] [--real]

`--real`: the same runs on real kubelets (`kpx_cluster.migration_real`: a RealCluster per run,
its own control plane; the backends are real pods), written to
bench/results/migration-real-kubelets.md.

A fresh local control plane; kpx installed from its manifests (the operator and the agents run
from the built images under runc: `make image`, or $KPX_IMAGES_DIR) in mode iptables on three
simulated nodes; backends (one per node) behind two ClusterIP Services and a NodePort. A load
client in a pod netns on every node opens a new TCP connection every 15 ms, round-robin over the
three ClusterIPs and the NodePort on each node's address, exchanges a UDP datagram every 20 ms
the same way, and holds two connections open exchanging a line every 100 ms. First, on three
other nodes, upstream kube-proxy v1.36.2 in iptables mode, then in nftables mode, is taken over
by kpx in nftables mode (`kpx_cluster.migration_takeover`: takeover.fromKubeProxy and
moveKubeProxyOff). Then spec.mode goes iptables -> nftables, and nftables -> iptables; each
switch waits until every node runs a Ready agent of the new mode, the ProxyConfiguration is
Ready in it and no node has the old mode's rules left (`kpx_cluster.migration`). Prints the
table and writes bench/results/migration.md.
Exit status 1 when a switch failed a connection, lost an exchange, broke a held connection or
left a rule behind.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import bench_cluster, exit_on_sigterm, log
from kpx_cluster.controlplane import Cluster
from kpx_cluster.migration import (
    TABLE_HEAD,
    LoadOptions,
    RefusalResult,
    SwitchResult,
    migration_cluster,
    preflight_load,
    switch,
    switch_with_refusal,
    table_row,
)
from kpx_cluster.migration_real import real_kube_proxy_cluster, real_migration_cluster
from kpx_cluster.migration_takeover import kube_proxy_cluster, take_over

RESULTS = Path(__file__).resolve().parent / "results"
SWITCHES = (("iptables", "nftables"), ("nftables", "iptables"))
#: upstream kube-proxy's modes taken over (by kpx in nftables)
KUBE_PROXY_MODES = ("iptables", "nftables")


def refusal_report(r: RefusalResult) -> list[str]:
    loads = SwitchResult(r.old, r.new, 0, 0.0, r.loads, {})
    problems = r.traffic_failures()
    lifted = (
        f"{r.after_lift:.1f} s after the refusal was lifted"
        if r.after_lift is not None
        else "not within 300 s of lifting the refusal"
    )
    return [
        "",
        f"## Injected failure: {r.old} -> {r.new} with nftables refused on one node",
        "",
        f"On {r.refused_node} a process owns the table `ip kpx` (`flags owner`: the kernel "
        "refuses any other socket's change to it, EPERM), so the new agent there cannot "
        f"program nftables. spec.mode was patched under the same load (with "
        "spec.modeSwitch.rollbackOnFailure false: the node is Stuck, its agent retries) and "
        f"watched for {r.held_for:.0f} s, then the refusal was lifted.",
        "",
        f"- agents after {r.held_for:.0f} s: "
        + ", ".join(f"{n}: {s}" for n, s in r.agents.items()),
        f"- ProxyConfiguration then: {r.status}; Ready={r.ready_condition.get('status')} "
        f"({r.ready_condition.get('reason')}: {r.ready_condition.get('message')})",
        "- over time (seconds after the patch: agents; the ProxyConfiguration's Ready):",
        *(
            f"  - +{t}s: " + ", ".join(f"{n} {s}" for n, s in states.items()) + f"; Ready {ready}"
            for t, states, ready in r.timeline
        ),
        f"- {r.old} rules on {r.refused_node} then: {'kept' if r.old_rules_kept else 'gone'}",
        f"- traffic over the whole run ({loads.load_seconds:.0f} s): new TCP connections "
        f"{loads.total('tcp', 'tried')} tried / {loads.total('tcp', 'failed')} failed; UDP "
        f"{loads.total('udp', 'tried')} / {loads.total('udp', 'failed')} lost; held "
        f"{loads.held_survived} of {loads.held} survived",
        f"- rollout finished {lifted}",
        *(f"- failure: {p}" for p in problems),
    ]


def report(results: list[SwitchResult], opts: LoadOptions, nodes: int, real: bool) -> str:
    where = (
        f"{nodes} real nodes (a kubelet and containerd each), operator and agents from the "
        "images, backends as real pods."
        if real
        else f"{nodes} simulated nodes, operator and agents from the images under runc."
    )
    lines = [
        "# Mode switches under load (bench/migration.py, `make bench-migration`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, " + where,
        f"Load per node (a client pod netns on each): a new TCP connection every "
        f"{opts.interval * 1000:.0f} ms over 2 ClusterIPs, a NodePort's ClusterIP and the "
        f"NodePort on every node's address; a UDP exchange every {opts.udp_interval * 1000:.0f} "
        f"ms over the same; {opts.holds} connections held open, a line every 100 ms. A try "
        f"fails without an answer within {opts.timeout:.0f} s; 'slow' answered after more than "
        "0.9 s (a retransmitted SYN or datagram). Rollout: from the patch of spec.mode until "
        "every node runs a Ready agent of the new mode, the ProxyConfiguration is Ready in it "
        "and no node has a rule, chain or table of the old mode. 'kube-proxy iptables -> "
        "nftables' (and 'kube-proxy nftables'): three nodes served by upstream kube-proxy "
        "v1.36.2 (the node simulator's kube-system/kube-proxy DaemonSet, from its image "
        "under runc) when kpx is "
        "installed with mode nftables and takeover {fromKubeProxy, moveKubeProxyOff}; its "
        "rollout: from the install until every node runs a Ready agent, no kube-proxy Pod, "
        "status.takeover KubeProxyRulesRemoved everywhere and no kube-proxy chain or table "
        "on any node.",
        "",
        TABLE_HEAD,
        *(table_row(r) for r in results),
        "",
        "Per node, seconds from the patch until its new agent was Ready:",
        "",
    ]
    for r in results:
        lines.append(
            f"- {r.switch}: "
            + ", ".join(f"{n} {t}s" for n, t in sorted(r.node_ready.items(), key=lambda x: x[1]))
        )
    problems = [f"- {r.switch}: {p}" for r in results for p in r.failures()]
    lines += ["", "Failures:" if problems else "No failures.", *problems, ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.015)
    parser.add_argument("--udp-interval", type=float, default=0.02)
    parser.add_argument("--holds", type=int, default=2)
    parser.add_argument(
        "--no-inject", action="store_true", help="skip the switch with nftables refused on one node"
    )
    parser.add_argument("--hold-refusal", type=float, default=90.0)
    parser.add_argument(
        "--no-takeover", action="store_true", help="skip the takeover from upstream kube-proxy"
    )
    parser.add_argument(
        "--only-takeover", action="store_true", help="only the takeover from upstream kube-proxy"
    )
    real_help = "on real kubelets (kpx_cluster.migration_real), not the node simulator"
    parser.add_argument("--real", action="store_true", help=real_help)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or RESULTS / ("migration-real-kubelets.md" if args.real else "migration.md")
    opts = LoadOptions(interval=args.interval, udp_interval=args.udp_interval, holds=args.holds)
    exit_on_sigterm()
    results: list[SwitchResult] = []
    refusal: RefusalResult | None = None
    with contextlib.ExitStack() as stack:
        cluster = None if args.real else stack.enter_context(bench_cluster("bench-migration"))
        if not args.no_takeover:
            results += [takeover_run(cluster, opts, args.nodes, m) for m in KUBE_PROXY_MODES]
        if args.only_takeover:
            stack.close()
            return finish(results, None, opts, args)
        first = SWITCHES[0][0]
        env = stack.enter_context(
            real_migration_cluster(first, nodes=args.nodes, log=log)
            if cluster is None
            else migration_cluster(cluster, first, nodes=args.nodes, log=log)
        )
        exit_on_sigterm()  # the Topology installed its own handlers
        baseline = preflight_load(env)
        broken = [f for s in baseline for f in (s.tcp.failures + s.udp.failures)]
        if broken:
            log(f"the load fails before any switch: {broken[:5]}")
            return 2
        for old, new in SWITCHES:
            result = switch(env, old, new, opts, log=log)
            results.append(result)
            log(table_row(result))
        if not args.no_inject:
            refusal = switch_with_refusal(
                env, "iptables", "nftables", env.nodes[1], args.hold_refusal, opts, log=log
            )
    return finish(results, refusal, opts, args)


def takeover_run(cluster: Cluster | None, opts: LoadOptions, nodes: int, mode: str) -> SwitchResult:
    """Three nodes served by upstream kube-proxy in `mode` taken over by kpx (nftables); on
    real kubelets when `cluster` is None."""
    with (
        real_kube_proxy_cluster(mode, nodes=nodes, log=log)
        if cluster is None
        else kube_proxy_cluster(cluster, mode, nodes=nodes, log=log)
    ) as env:
        exit_on_sigterm()  # the Topology installed its own handlers
        broken = [f for s in preflight_load(env) for f in (s.tcp.failures + s.udp.failures)]
        if broken:
            raise SystemExit(f"the load fails through kube-proxy before the takeover: {broken[:5]}")
        result = take_over(env, mode, opts, log=log)
        log(table_row(result))
        return result


def finish(
    results: list[SwitchResult],
    refusal: RefusalResult | None,
    opts: LoadOptions,
    args: argparse.Namespace,
) -> int:
    text = report(results, opts, args.nodes, args.real)
    if refusal is not None:
        text += "\n".join(refusal_report(refusal)) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 1 if any(r.failures() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
