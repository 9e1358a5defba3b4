"""`proxy-cluster`: start, inspect and stop the local control plane, alone on loopback or, with
`up --nodes N`, in a netns of its own with N real kubelet nodes (docs/real-kubelets.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .binaries import MissingBinary, kubernetes_bin_dir
from .controlplane import DEFAULT_ROOT, AlreadyRunning, Cluster, StartupFailed
from .kubelets import background


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxy-cluster",
        description="A real local Kubernetes control plane (etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler) on loopback.",
    )
    parser.add_argument("--name", default="kpx", help="cluster name (default: kpx)")
    parser.add_argument(
        "--root", type=Path, default=DEFAULT_ROOT, help=f"state root (default: {DEFAULT_ROOT})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the control plane and print `export KUBECONFIG=...`")
    up.add_argument(
        "--nodes",
        type=int,
        default=0,
        metavar="N",
        help="also N real nodes (kubelet, containerd, CNI; the control plane moves into a "
        "netns of its own); default 0: the control plane alone on loopback",
    )
    sub.add_parser("down", help="stop everything `up` started and remove its state")
    sub.add_parser("status", help="say which components run and are healthy")
    return parser


def _up_real(name: str, root: Path, nodes: int) -> int:
    try:
        report = background.start(name, root, nodes)
    except (background.AlreadyUp, RuntimeError, MissingBinary) as exc:
        print(f"proxy-cluster: {exc}", file=sys.stderr)
        return 1
    node_ips = report["nodes"]
    assert isinstance(node_ips, dict)
    print(f"cluster {name!r} is up in {report['seconds']}s: apiserver {report['server']}")
    for node, ip in node_ips.items():
        print(f"  node {node}: {ip}")
    print(f"logs: {report['logs']} (nodes: under nodes/<name>/logs)")
    print(f"export PATH={kubernetes_bin_dir()}:$PATH")
    print(f"export KUBECONFIG={report['kubeconfig']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cluster = Cluster(args.name, args.root)
    if args.command == "up" and args.nodes > 0:
        return _up_real(args.name, args.root, args.nodes)
    if args.command == "down" and background.Files.of(args.name, args.root).dir.exists():
        left = background.stop(args.name, args.root)
        print("stopped the nodes and the control plane" + (f"; LEFT: {left}" if left else ""))
        return 1 if left else 0
    if args.command == "up":
        try:
            cluster.up()
        except AlreadyRunning as exc:
            print(f"proxy-cluster: {exc}", file=sys.stderr)
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            return 0
        except (StartupFailed, MissingBinary) as exc:
            print(f"proxy-cluster: {exc}", file=sys.stderr)
            return 1
        print(f"cluster {cluster.name!r} is up: apiserver {cluster.server}")
        print(f"logs: {cluster.log_dir}")
        print(f"export PATH={kubernetes_bin_dir()}:$PATH")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return 0
    if args.command == "down":
        stopped = cluster.down()
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        return 0
    states = cluster.status()
    if not states:
        print(f"cluster {cluster.name!r}: not running")
        return 3
    for name, healthy in states.items():
        print(f"{name:<26} {'healthy' if healthy else 'DOWN'}")
    return 0 if all(states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
