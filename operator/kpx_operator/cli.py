"""`proxy-operator`: run the kpx operator (kopf, cluster-wide, behind a Lease)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import sys
from pathlib import Path

import kopf
from aiohttp import web

from kpx_api import parse_bind_address
from kpx_api.constants import GROUP, PLURAL, VERSION
from kpx_api.names import (
    LABEL_KEY_MAX_LENGTH,
    LABEL_KEY_MESSAGE,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_MAX_LENGTH,
    LABEL_VALUE_MESSAGE,
    LABEL_VALUE_PATTERN,
)
from kpx_kube import logformat

from .admission import IPVSPolicy
from .apiserver import ApiError, ApiServer, Credentials, from_kubeconfig, in_cluster
from .builders import DEFAULT_AGENT_IMAGE, BuildOptions, operator_env
from .handlers import register
from .health import LEADING, STANDBY, STOPPED, OperatorHealth, probe_loop
from .kopf_storage import DigestDiffBaseStorage
from .leader import LeaderElector, default_identity
from .metrics import CONTENT_TYPE, OperatorMetrics
from .names import (
    AGENT_APP,
    AGENT_SERVICE_ACCOUNT,
    DEFAULT_NAMESPACE,
    FIELD_MANAGER,
    FINALIZER,
    LEASE_NAME,
    RESTART_HASH_ANNOTATION,
    labels,
)
from .reconciler import OperatorConfig, Reconciler
from .status import DEFAULT_ROLLOUT_DEADLINE

log = logging.getLogger("kpx_operator")


def _endpoint(text: str) -> str:
    """HOST:PORT (IPv6 in brackets; a DNS name is fine too)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def _bind(text: str) -> str:
    if text:
        try:
            parse_bind_address(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _pod_annotation(text: str) -> tuple[str, str]:
    key, value = _key_value(text)
    if len(key) > LABEL_KEY_MAX_LENGTH or not re.match(LABEL_KEY_PATTERN, key):
        raise argparse.ArgumentTypeError(f"annotation key {key!r} {LABEL_KEY_MESSAGE}")
    if key == RESTART_HASH_ANNOTATION:
        raise argparse.ArgumentTypeError(f"annotation {key} is the operator's own")
    return key, value


def _pod_label(text: str) -> tuple[str, str]:
    key, value = _pod_annotation(text)
    if len(value) > LABEL_VALUE_MAX_LENGTH or not re.match(LABEL_VALUE_PATTERN, value):
        raise argparse.ArgumentTypeError(f"label {key}: value {value!r} {LABEL_VALUE_MESSAGE}")
    if key in labels("x", AGENT_APP):
        raise argparse.ArgumentTypeError(
            f"label {key} is the operator's own (the agents' DaemonSet selects its pods by it)"
        )
    return key, value


def _agent_env(text: str) -> tuple[str, str]:
    name, value = _key_value(text)
    if not re.match(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", name):
        raise argparse.ArgumentTypeError(
            f"environment variable name {name!r}: letters, digits, '_', '-' and '.', not "
            "starting with a digit"
        )
    if operator_env(name):
        raise argparse.ArgumentTypeError(
            f"environment variable {name} is the operator's own (NODE_NAME, POD_*, "
            "KUBERNETES_SERVICE_*, KPX_*)"
        )
    return name, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="proxy-operator",
        description="kpx operator: runs the node agents that each ProxyConfiguration asks for.",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        help="namespace of the agents, their ConfigMaps and the leader Lease "
        f"(default: $POD_NAMESPACE, else {DEFAULT_NAMESPACE})",
    )
    p.add_argument(
        "--ipvs-policy",
        choices=[p.value for p in IPVSPolicy],
        default=IPVSPolicy.WARN.value,
        help="mode ipvs (deprecated upstream): allow it, warn (a Warning event; default), or "
        "deny it (nothing deployed, status Degraded)",
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        default=Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None,
        help="default: $KUBECONFIG, else the in-cluster service account",
    )
    p.add_argument(
        "--apiserver-endpoint",
        type=_endpoint,
        metavar="HOST:PORT",
        help="apiserver address for the agents (KUBERNETES_SERVICE_HOST/PORT in their pods); "
        "needed when nothing proxies the kubernetes Service yet, e.g. without kube-proxy",
    )
    p.add_argument(
        "--agent-image",
        default=os.environ.get("KPX_AGENT_IMAGE") or DEFAULT_AGENT_IMAGE,
        metavar="IMAGE",
        help="image of the agents of every ProxyConfiguration that sets no spec.image "
        f"(default: $KPX_AGENT_IMAGE, else {DEFAULT_AGENT_IMAGE}, this release's agent)",
    )
    p.add_argument(
        "--image-pull-secret",
        action="append",
        default=[],
        metavar="NAME",
        dest="image_pull_secrets",
        help="a Secret of the agents' namespace that their pods pull the image with "
        "(repeat for several)",
    )
    p.add_argument(
        "--agent-service-account",
        default=AGENT_SERVICE_ACCOUNT,
        metavar="NAME",
        help="ServiceAccount of the agents' pods, in the agents' namespace, installed with "
        f"the operator (default {AGENT_SERVICE_ACCOUNT})",
    )
    p.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        dest="agent_args",
        help="an argument appended to every agent's command line, e.g. --agent-arg=-v "
        "(repeat for several)",
    )
    p.add_argument(
        "--agent-pod-annotation",
        action="append",
        default=[],
        type=_pod_annotation,
        metavar="KEY=VALUE",
        dest="agent_pod_annotations",
        help="an annotation of every agent pod (repeat for several)",
    )
    p.add_argument(
        "--agent-pod-label",
        action="append",
        default=[],
        type=_pod_label,
        metavar="KEY=VALUE",
        dest="agent_pod_labels",
        help="a label of every agent pod, besides the operator's own (repeat for several)",
    )
    p.add_argument(
        "--agent-env",
        action="append",
        default=[],
        type=_agent_env,
        metavar="NAME=VALUE",
        dest="agent_env",
        help="an environment variable of every agent container, besides the operator's own "
        "(repeat for several)",
    )
    p.add_argument(
        "--resync-interval",
        type=float,
        default=10.0,
        help="seconds between re-applies of every ProxyConfiguration's children (drift "
        "repair) and status refreshes (default 10)",
    )
    p.add_argument(
        "--cleanup-timeout",
        type=float,
        default=300.0,
        help="seconds a deletionPolicy Cleanup deletion waits without progress (no node "
        "turning clean) before it gives up on the nodes left (default 300)",
    )
    p.add_argument(
        "--rollout-deadline",
        type=float,
        default=DEFAULT_ROLLOUT_DEADLINE,
        help="seconds an agent rollout may go without progress (no node more updated or "
        "ready) before condition Stalled says RolloutDeadlineExceeded (kstatus then reads "
        "Failed; 0: no deadline; default "
        f"{DEFAULT_ROLLOUT_DEADLINE:g})",
    )
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"take the Lease {LEASE_NAME} before acting, so replicas never act at once "
        "(default on)",
    )
    p.add_argument(
        "--health-address",
        type=_bind,
        default="0.0.0.0:8080",
        help="IP:port of /healthz (liveness: its watch and its leadership) and /readyz "
        "(readiness), every replica; empty: none (default 0.0.0.0:8080)",
    )
    p.add_argument(
        "--metrics-address",
        type=_bind,
        default="0.0.0.0:8081",
        help="IP:port of /metrics (Prometheus: reconciles, errors, durations, leadership, "
        "process); empty: none (default 0.0.0.0:8081)",
    )
    p.add_argument(
        "--health-probe-interval",
        type=float,
        default=10.0,
        help="seconds between the lists of ProxyConfigurations that /healthz's watch check "
        "makes; 3 failures in a row make /healthz fail (default 10)",
    )
    logformat.add_arguments(p)
    return p


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    # kopf's own bookkeeping lives in status.kopf, which the CRD keeps (preserve-unknown-
    # fields); the objects carry no kopf annotations. Its "last handled" state is a digest,
    # not a copy of the spec (kopf_storage.py).
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = DigestDiffBaseStorage()
    # Events: the ones the reconciler posts, and kopf's warnings/errors; not a Normal event
    # per timer tick.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = FIELD_MANAGER
    settings.posting.event_name_prefix = f"{FIELD_MANAGER}-"
    # One active replica is ensured by the Lease; no kopf peering objects needed.
    settings.peering.standalone = True
    # Serve the resources that exist at start (`wait_for_crd`), without watching every CRD
    # and Namespace of the cluster: that would need cluster-wide read access to both.
    settings.scanning.disabled = True
    return settings


def health_app(health: OperatorHealth) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        code, body = health.healthz()
        return web.json_response(body, status=code)

    async def readyz(_: web.Request) -> web.Response:
        code, body = health.readyz()
        return web.json_response(body, status=code)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def metrics_app(metrics: OperatorMetrics, elector: LeaderElector | None) -> web.Application:
    async def serve_metrics(_: web.Request) -> web.Response:
        metrics.leader = 1 if elector is None or elector.is_leader else 0
        return web.Response(
            body=metrics.exposition().encode(), headers={"Content-Type": CONTENT_TYPE}
        )

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    return app


async def _serve(address: str, app: web.Application) -> web.AppRunner | None:
    if not address:
        return None
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = parse_bind_address(address)
    await web.TCPSite(runner, host, port).start()
    return runner


async def wait_for_crd(api: ApiServer, interval: float = 5.0) -> None:
    """Wait until the apiserver serves ProxyConfigurations (the CRD may come later)."""
    path = f"/apis/{GROUP}/{VERSION}"
    while True:
        try:
            _, found = await api.request("GET", path)
            if any(r.get("name") == PLURAL for r in found.get("resources") or []):
                return
        except ApiError as exc:
            if exc.status not in (0, 404, 503):
                raise
        log.warning("%s/%s is not served (is the CRD installed?); waiting", GROUP, VERSION)
        await asyncio.sleep(interval)


def build_options(args: argparse.Namespace) -> BuildOptions:
    """What the command line says of the children (parser()'s arguments)."""
    return BuildOptions(
        namespace=args.namespace,
        apiserver_endpoint=args.apiserver_endpoint,
        agent_image=args.agent_image,
        image_pull_secrets=tuple(args.image_pull_secrets),
        agent_service_account=args.agent_service_account,
        agent_args=tuple(args.agent_args),
        agent_pod_annotations=tuple(args.agent_pod_annotations),
        agent_pod_labels=tuple(args.agent_pod_labels),
        agent_env=tuple(args.agent_env),
    )


async def run(args: argparse.Namespace) -> int:
    creds: Credentials = from_kubeconfig(args.kubeconfig) if args.kubeconfig else in_cluster()
    api = ApiServer(creds)
    config = OperatorConfig(
        build=build_options(args),
        ipvs_policy=IPVSPolicy(args.ipvs_policy),
        cleanup_timeout=args.cleanup_timeout,
        rollout_deadline=args.rollout_deadline or None,
    )
    registry = kopf.OperatorRegistry()
    metrics = OperatorMetrics()
    register(
        registry,
        Reconciler(api, config),
        creds,
        namespace=args.namespace,
        resync_interval=args.resync_interval,
        metrics=metrics,
    )
    # One identity for the lease and for kopf: kopf's own default asks the password database
    # for the user's name, which a container running as a uid the image does not list (the
    # shipped runAsUser 65532) has not got: kopf died with KeyError at start.
    identity = default_identity()
    elector = (
        LeaderElector(api, args.namespace, LEASE_NAME, identity) if args.leader_elect else None
    )
    health = OperatorHealth(leader_elect=elector is not None)
    if elector is not None:
        api.fence = elector.lease_left  # no write past the leadership's deadline
        health.lease_left = elector.lease_left
    servers = [
        await _serve(args.health_address, health_app(health)),
        await _serve(args.metrics_address, metrics_app(metrics, elector)),
    ]
    probe = asyncio.create_task(
        probe_loop(
            health,
            lambda: api.request("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}", params={"limit": "1"}),
            args.health_probe_interval,
        )
    )
    try:
        await wait_for_crd(api)
        if elector is not None:
            health.role = STANDBY
            await elector.acquire()
        health.role = LEADING
        ready = asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(
                registry=registry,
                settings=operator_settings(),
                clusterwide=True,
                standalone=True,
                identity=identity,  # type: ignore[arg-type]  # kopf: NewType of str
                ready_flag=ready,
            )
        )
        operator.add_done_callback(lambda task: _operator_ended(health, task))
        watching = asyncio.create_task(_watching(health, ready))
        lost = asyncio.create_task(elector.hold()) if elector is not None else None
        await asyncio.wait({t for t in (operator, lost) if t}, return_when="FIRST_COMPLETED")
        if lost is not None and lost.done():
            # At the write deadline, before another replica can take the Lease: the apply
            # edge refuses every write from now on, and kopf (whose own patches do not go
            # through it) is cancelled at once rather than given time to finish its work.
            log.error("not the leader any more: stopping")
            health.role = STOPPED
            operator.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await operator
            return 1
        if lost is not None:
            lost.cancel()
        watching.cancel()
        operator.result()
        return 0
    finally:
        probe.cancel()
        if elector is not None:
            await elector.release()
        await api.close()
        for server in servers:
            if server is not None:
                await server.cleanup()


async def _watching(health: OperatorHealth, ready: asyncio.Event) -> None:
    await ready.wait()
    health.watching = True
    log.info("watching ProxyConfigurations")


def _operator_ended(health: OperatorHealth, task: asyncio.Task[None]) -> None:
    health.watching = False
    if task.cancelled():
        health.operator_ended = "cancelled"
    else:
        exc = task.exception()
        health.operator_ended = repr(exc) if exc is not None else "returned"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    logformat.configure(args.logging_format, args.verbosity)
    if args.verbosity < logformat.DEBUG_VERBOSITY:
        # kopf logs every handler run at INFO (a timer tick every few seconds per object).
        logging.getLogger("kopf").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(args))
    except ValueError as exc:  # bad kubeconfig / not in a cluster
        print(f"proxy-operator: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
