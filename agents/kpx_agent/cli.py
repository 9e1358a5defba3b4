"""`proxy-agent`: run the node agent, or `proxy-agent cleanup` to remove its rules."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kpx_api.constants import (
    KUBE_PROXY_RULES_REMOVED,
    WAITING_FOR_KUBE_PROXY,
)
from kpx_api.errors import ConfigError
from kpx_api.modes import has_backend, no_backend_message
from kpx_api.networks import parse_bind_address
from kpx_api.nodestate import LeftoverKind
from kpx_kube import (
    DEFAULT_WATCH_IDLE_TIMEOUT,
    Client,
    KubeconfigError,
    from_kubeconfig,
    in_cluster,
    logformat,
)
from kpx_kube.watch_events import decode_list

from . import backends
from . import settings as settings_mod
from .agent import Agent
from .backends.base import Backend, Handover, Mode, NodePaths
from .conntrack import sysctl as conntrack_sysctl
from .handover import preflight
from .handover.from_kube_proxy import (
    KUBE_PROXY_DAEMONSET,
    KUBE_PROXY_NAMESPACE,
    kube_proxy_ipvs_mode_here,
    kube_proxy_runs_here,
    remove_kube_proxy_leftovers,
)
from .handover.make_before_break import Leftover, other_mode_leftovers
from .model.types import DataplaneSettings
from .observability.http_endpoints import health_app, serve
from .observability.metrics import AgentMetrics
from .observability.node_state import DEFAULT_WRITE_INTERVAL
from .observability.proxy_health import ProxyHealth
from .settings import AgentSettings
from .state_api.address import parse_address
from .state_api.socket_directory import SocketDirectoryError, prepare_socket_directory

log = logging.getLogger("kpx_agent")
MODES = ("nftables", "iptables", "ipvs", "external")


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: a number of seconds above 0 is needed")
    return value


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text}: a number of seconds, 0 or more, is needed")
    return value


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="proxy-agent",
        description="kpx node agent: proxies Kubernetes Services on this node. "
        "`proxy-agent cleanup --mode MODE` removes the rules of MODE and exits; "
        "`proxy-agent explain-migration --from ipvs --to nftables` lists what a switch changes; "
        "`proxy-agent convert-kube-proxy-config FILE` converts kube-proxy's configuration.",
    )
    p.add_argument("--mode", choices=MODES, help="dataplane (default: the config file's mode)")
    p.add_argument("--config", type=Path, help="AgentConfiguration file (default: mode defaults)")
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="this node's name (default: $NODE_NAME, else the hostname)",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        help="default: in-cluster service account (a cluster's disable-compression is honoured)",
    )
    p.add_argument(
        "--watch-idle-timeout",
        type=_positive_seconds,
        default=DEFAULT_WATCH_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="drop a watch that receives no byte for this long (a half-open connection) and "
        f"resume it on a new connection (default {DEFAULT_WATCH_IDLE_TIMEOUT:g}: above the "
        "apiserver's 60 s bookmark period)",
    )
    p.add_argument("--cluster-cidr", action="append", help="pod CIDR (repeat for dual-stack)")
    p.add_argument("--healthz-bind-address", help="IP:port of /healthz and /livez")
    p.add_argument("--metrics-bind-address", help="IP:port of /metrics")
    p.add_argument(
        "--conntrack-sysctl-dir",
        type=Path,
        default=conntrack_sysctl.DEFAULT_SYSCTL_DIR,
        help="the node's net/netfilter sysctls, where spec.conntrack is applied (default: "
        "%(default)s; a pod mounts the node's directory elsewhere, since its own /proc/sys "
        "is read-only)",
    )
    p.add_argument(
        "--conntrack-hashsize-file",
        type=Path,
        default=conntrack_sysctl.DEFAULT_HASHSIZE_FILE,
        help="the nf_conntrack module's hashsize parameter (default: %(default)s)",
    )
    p.add_argument(
        "--route-localnet-file",
        type=Path,
        help="localhost NodePorts (iptables.localhostNodePorts, nftables.localhostNodePorts): "
        "the node's "
        "net.ipv4.conf.all.route_localnet (default: /proc/sys/net/ipv4/conf/all/route_localnet "
        "of the agent's network namespace; a pod mounts the node's file elsewhere)",
    )
    p.add_argument(
        "--ipv4-sysctl-dir",
        type=Path,
        help="mode ipvs: the node's net/ipv4 sysctls, where the agent sets vs.conntrack, "
        "vs.expire_nodest_conn, vs.expire_quiescent_template and, with strictARP, "
        "conf.all.arp_ignore and arp_announce (default: /proc/sys/net/ipv4 of the agent's "
        "network namespace; a pod mounts the node's directory elsewhere)",
    )
    p.add_argument(
        "--state-socket",
        metavar="PATH",
        help="serve the node-local state API (gRPC, kpx.localstate.v1) on this unix socket "
        "(or unix:///PATH, or tcp://127.0.0.1:PORT); overrides the configuration's stateAPI",
    )
    logformat.add_arguments(p)
    p.add_argument(
        "--node-state-period",
        type=_non_negative_seconds,
        default=DEFAULT_WRITE_INTERVAL,
        metavar="SECONDS",
        help="write this node's ProxyNodeState when it changes, at most once per SECONDS "
        f"(default {DEFAULT_WRITE_INTERVAL:g}; 0: never write it)",
    )
    return p


def _cleanup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="proxy-agent cleanup", description="Remove every rule and table of MODE, then exit."
    )
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument(
        "--then-serve-healthz",
        metavar="IP:PORT",
        help="after cleaning, answer 200 on /healthz there until stopped (so a cleanup "
        "DaemonSet's pod turns Ready once its node is clean)",
    )
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.cluster_cidr:
        out["clusterCIDRs"] = [c for arg in args.cluster_cidr for c in arg.split(",") if c]
    if args.healthz_bind_address:
        out["healthzBindAddress"] = args.healthz_bind_address
    if args.metrics_bind_address:
        out["metricsBindAddress"] = args.metrics_bind_address
    if args.state_socket:
        address = args.state_socket
        address = f"unix://{address}" if address.startswith("/") else address
        out["stateAPI"] = {"enabled": True, "address": address}
    return out


def _state_socket_problem(settings: AgentSettings, args: argparse.Namespace) -> str | None:
    """Prepare the state socket's directory (state_api/socket_directory.py) before anything
    else runs: why it cannot be used, naming the flag or field that gave the path, or None."""
    if settings.state_api is None:
        return None
    path = parse_address(settings.state_api).path
    if path is None:
        return None
    try:
        prepare_socket_directory(path.parent)
    except SocketDirectoryError as exc:
        source = "--state-socket" if args.state_socket else "stateAPI.address"
        return f"{source} {path}: {exc}"
    return None


def cleanup(argv: list[str]) -> int:
    args = _cleanup_parser().parse_args(argv)
    if not has_backend(args.mode):
        print(f"proxy-agent: {no_backend_message(args.mode)}", file=sys.stderr)
        return 2
    backends.load(args.mode).cleanup()
    print(f"removed the {args.mode} rules of kpx", flush=True)
    if args.then_serve_healthz:
        host, port = parse_bind_address(args.then_serve_healthz)
        asyncio.run(_serve_done(host, port))
    return 0


async def _serve_done(host: str, port: int) -> None:
    # Nothing is ever queued: healthy for as long as it runs.
    runner = await serve(health_app(ProxyHealth(timeout=0.0), AgentMetrics()), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def explain_migration(argv: list[str]) -> int:
    """List what moving this cluster from ipvs to nftables changes (migration.py)."""
    p = argparse.ArgumentParser(
        prog="proxy-agent explain-migration",
        description="What a switch from mode ipvs to nftables changes for this cluster.",
    )
    p.add_argument("--from", dest="source", choices=["ipvs"], required=True)
    p.add_argument("--to", dest="target", choices=["nftables"], required=True)
    p.add_argument("--config", type=Path, help="the ipvs AgentConfiguration (default: defaults)")
    p.add_argument(
        "--kubeconfig",
        type=Path,
        help="list the Services with this kubeconfig (default: in-cluster credentials)",
    )
    args = p.parse_args(argv)
    from kpx_api.modes import IPVSSettings

    from .handover.migration import explain, render

    try:
        config = settings_mod.load("ipvs", args.config)
        block = config.mode_settings()
        if not isinstance(block, IPVSSettings):
            raise ValueError(f"{args.config} is for mode {config.mode}, not ipvs")
        creds = from_kubeconfig(args.kubeconfig) if args.kubeconfig else in_cluster()
    except (ConfigError, ValueError, KubeconfigError) as exc:
        print(f"proxy-agent explain-migration: {exc}", file=sys.stderr)
        return 2

    async def services() -> list[dict[str, Any]]:
        client = Client(creds)
        try:
            data = await client.list("services", "/api/v1/services", {})
        finally:
            await client.close()
        return decode_list(data).items

    items = asyncio.run(services())
    print(render(explain(block, items), len(items)), end="")
    return 0


def convert_kube_proxy_config(argv: list[str]) -> int:
    """Print the ProxyConfiguration doing what a kube-proxy configuration did
    (kube_proxy_config.py); name on stderr what it does not carry. Exit 1 when a field in use
    is not carried, 2 on input that cannot be read."""
    p = argparse.ArgumentParser(
        prog="proxy-agent convert-kube-proxy-config",
        description="Convert kube-proxy's configuration (the kube-system/kube-proxy ConfigMap "
        "of kubeadm, or a bare KubeProxyConfiguration) into a ProxyConfiguration, printed on "
        "stdout. Every field not carried is named on stderr; the exit status is 1 when one of "
        "them is in use and kpx does not do what it asked.",
    )
    p.add_argument("file", nargs="?", default="-", help="the YAML to read (default: stdin)")
    p.add_argument("--name", default="default", help="the ProxyConfiguration's name")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="set spec.takeover.fromKubeProxy "
        "and moveKubeProxyOff: the agents take the nodes over from the running "
        "kube-proxy node by node (docs/migrating.md)",
    )
    p.add_argument(
        "--to-nftables",
        action="store_true",
        help="mode nftables where "
        "kube-proxy ran iptables (its settings both modes have are carried; what "
        "only iptables does is named)",
    )
    args = p.parse_args(argv)
    from .handover.kube_proxy_config import ConversionError, convert, read_document, render

    prog = "proxy-agent convert-kube-proxy-config"
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        conversion = convert(read_document(text), args.name, args.takeover, args.to_nftables)
    except (OSError, ConversionError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(render(conversion, "stdin" if args.file == "-" else args.file), end="")
    for dropped in conversion.dropped:
        print(f"{prog}: {dropped.render()}", file=sys.stderr)
    if conversion.lost:
        print(
            f"{prog}: {len(conversion.lost)} field(s) in use not carried: review them before "
            "applying",
            file=sys.stderr,
        )
        return 1
    return 0


def handover(settings: DataplaneSettings) -> Handover:
    """What this agent hands a mode whose leftovers it removes (backends.base.Handover)."""
    return Handover(settings, kube_proxy_ipvs_mode_here)


def remove_other_modes(mode: str) -> None:
    """Remove at once what agents of the other modes left on this node (a failure is logged).
    The agent itself does this only after its first verified sync (`leftovers_for`)."""
    for leftover in other_mode_leftovers(
        mode, backends.REGISTRY, backends.load, handover(DataplaneSettings())
    ):
        try:
            leftover.remove()
        except Exception as exc:
            log.warning("could not remove %s: %s", leftover.description, exc)


def kube_proxy_leftover(client: Client, node_name: str, settings: AgentSettings) -> Leftover:
    """spec.takeover.fromKubeProxy: upstream kube-proxy's rules, removed once its DaemonSet's
    Pod is gone from this node (IPVS too, unless the agent runs mode ipvs itself)."""
    include_ipvs = settings.mode != "ipvs"

    async def gone() -> bool:
        return not await kube_proxy_runs_here(client, node_name)

    return Leftover(
        "kube-proxy",
        "upstream kube-proxy's rules",
        lambda: remove_kube_proxy_leftovers(include_ipvs),
        gone,
        removed_reason=KUBE_PROXY_RULES_REMOVED,
        waiting_reason=WAITING_FOR_KUBE_PROXY,
        waiting_message=f"a Pod of {KUBE_PROXY_NAMESPACE}/{KUBE_PROXY_DAEMONSET} runs on this "
        "node: its rules are removed once it is gone (both proxies serve meanwhile)",
        rearm=True,
        returned_reason=WAITING_FOR_KUBE_PROXY,
        returned_message=f"a Pod of {KUBE_PROXY_NAMESPACE}/{KUBE_PROXY_DAEMONSET} runs on this "
        "node again: its rules are removed again once it is gone (both proxies serve meanwhile)",
        kind=LeftoverKind.KUBE_PROXY,
    )


def leftovers_for(client: Client, node_name: str) -> Callable[[AgentSettings], list[Leftover]]:
    """Make-before-break (handover/make_before_break.py): what an agent with a mode's settings
    removes once its first sync is verified, retrying what fails: the other modes' rules (each
    loaded from the registry only then), and upstream kube-proxy's with spec.takeover.fromKubeProxy.
    During a switch of mode the agent is not Ready until the old mode's are gone. After a rollback,
    the same for the rollback mode's settings."""

    def leftovers_of(settings: AgentSettings) -> list[Leftover]:
        leftovers = other_mode_leftovers(
            settings.mode, backends.REGISTRY, backends.load, handover(settings.proxy)
        )
        if settings.takeover_from_kube_proxy:
            leftovers.append(kube_proxy_leftover(client, node_name, settings))
        return leftovers

    return leftovers_of


def backend_for(paths: NodePaths) -> Callable[[AgentSettings], Backend]:
    """A backend for a mode's settings, from the registry (what a rollback runs)."""

    def create(settings: AgentSettings) -> Backend:
        return backends.load(settings.mode).create(settings.proxy, paths)

    return create


def build_agent(
    settings: AgentSettings, mode: Mode, args: argparse.Namespace, client: Client
) -> Agent:
    """The agent, with everything it runs with: the one place that puts it together. `mode`:
    the registry's module of `settings.mode`; `args`: the run parser's."""
    paths = NodePaths(route_localnet=args.route_localnet_file, ipv4_sysctls=args.ipv4_sysctl_dir)
    return Agent(
        settings,
        args.node_name,
        client,
        mode.create(settings.proxy, paths),
        config_path=args.config,
        overrides=_overrides(args),
        conntrack_paths=conntrack_sysctl.ConntrackPaths(
            args.conntrack_sysctl_dir, args.conntrack_hashsize_file
        ),
        backend_for=backend_for(paths),
        node_state_interval=args.node_state_period or None,
        # Make-before-break: the other modes' rules stay until this agent's own are in.
        leftovers_of=leftovers_for(client, args.node_name),
        preflight=preflight.check,
    )


async def _run_until_signal(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(agent.run())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("stopping; the rules stay in place for the next agent")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logformat.configure(logformat.early_format(argv), 0)
    if argv[:1] == ["cleanup"]:
        return cleanup(argv[1:])
    if argv[:1] == ["explain-migration"]:
        return explain_migration(argv[1:])
    if argv[:1] == ["convert-kube-proxy-config"]:
        return convert_kube_proxy_config(argv[1:])
    args = _run_parser().parse_args(argv)
    logformat.configure(args.logging_format, args.verbosity)
    if args.config is None and args.mode is None:
        print("proxy-agent: give --mode, --config, or both", file=sys.stderr)
        return 2
    try:
        config = settings_mod.load(args.mode or "nftables", args.config, _overrides(args))
        if args.mode and str(config.mode) != args.mode:
            raise ValueError(f"--mode {args.mode} but {args.config} says mode {config.mode}")
        settings = settings_mod.resolve(config)
    except (ConfigError, ValueError) as exc:
        print(f"proxy-agent: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if not has_backend(settings.mode):
        # The API accepts the mode (and the operator deploys nothing for it): say why this
        # agent cannot run it rather than fail on a missing module.
        print(f"proxy-agent: {no_backend_message(settings.mode)}", file=sys.stderr)
        return 2
    if (problem := _state_socket_problem(settings, args)) is not None:
        print(f"proxy-agent: {problem}", file=sys.stderr)
        return 2
    if settings.mode == "ipvs":
        log.warning("mode ipvs is deprecated upstream (KEP-5495): plan the move to nftables")
    try:
        mode = backends.load(settings.mode)
    except KeyError as exc:
        print(f"proxy-agent: {exc.args[0]}", file=sys.stderr)
        return 2
    try:
        creds = from_kubeconfig(args.kubeconfig) if args.kubeconfig else in_cluster()
    except KubeconfigError as exc:
        print(f"proxy-agent: credentials: {exc}", file=sys.stderr)
        return 2
    client = Client(creds, user_agent="kpx-agent", watch_idle_timeout=args.watch_idle_timeout)
    agent = build_agent(settings, mode, args, client)
    # Tens of thousands of long-lived objects arrive at start: with the default thresholds the
    # cyclic collector rescans them over and over (measured: decode 0.87 s -> 0.12 s at 10k).
    gc.set_threshold(100_000, 50, 100)
    log.info("starting in mode %s on node %s", settings.mode, args.node_name)
    asyncio.run(_run_until_signal(agent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
