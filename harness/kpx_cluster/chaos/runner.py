"""One row of the fault table: load on every node, inject, heal, converge, account.

`run_row(env, fault)` waits until the cluster is healthy (every agent Ready, the
ProxyConfiguration Ready, the base Services answered from every node), starts the load client
on every node (`kpx_cluster.migration._start_load`), injects the fault, makes its changes
(Services created while the fault holds, or at its heal for a fault that takes the apiserver
away), holds it, heals it, and waits until every change and the base Services answer from
every node's client netns: the seconds from the heal are the row's convergence. A change that
does not answer on some node within `Options.converge_timeout` is lost. The load stops after
`Options.settle` s; its tries are split between the nodes the fault touches and the others
(`table.account`).
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kpx_cluster.migration import (
    TCP_PORT,
    LoadOptions,
    MigrationEnv,
    _start_load,
    _stop_load,
    wait_until,
)
from kpx_cluster.netns import Node
from kpx_cluster.nodesim import netns as sim_netns

from .procs import restart_agent
from .table import RowResult, account

Log = Callable[[str], None]


@dataclass
class Options:
    load: LoadOptions = field(default_factory=LoadOptions)
    #: multiplies every fault's hold time (1: the durations of the issue; less when developing)
    scale: float = 1.0
    converge_timeout: float = 180.0
    healthy_timeout: float = 240.0
    settle: float = 3.0
    #: the mode kpx runs in for the rows being run (the suite switches modes between groups)
    mode: str = "nftables"


@dataclass
class Change:
    """A Service created during a fault: it must answer on every node after the heal."""

    name: str
    namespace: str
    ip: str
    port: int = TCP_PORT


@dataclass
class Ctx:
    env: MigrationEnv
    opts: Options
    log: Log
    run: str = field(default_factory=lambda: secrets.token_hex(2))
    created: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, namespace, name)
    notes: list[str] = field(default_factory=list)
    #: the changes made while the fault holds (set by run_row)
    changes: list[Change] = field(default_factory=list)

    def seconds(self, s: float) -> float:
        return max(1.0, s * self.opts.scale)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        return self.env.cluster.kubectl(*args, check=check, input=input).stdout

    def service(
        self, name: str, namespace: str | None = None, selector: bool = True, **spec: Any
    ) -> Change:
        """Create a ClusterIP Service on the backends (TCP 80 -> 8080); its Change."""
        return self.services([name], namespace, selector, **spec)[0]

    def services(
        self,
        names: Sequence[str],
        namespace: str | None = None,
        selector: bool = True,
        **spec: Any,
    ) -> list[Change]:
        """`service` for each name, in one `kubectl create` of a List (a burst)."""
        ns = namespace or self.env.app_ns
        items = []
        for name in names:
            body: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "ports": [
                        {"name": "tcp", "port": TCP_PORT, "targetPort": 8080, "protocol": "TCP"}
                    ],
                    **spec,
                },
            }
            if selector:
                body["spec"]["selector"] = {"app": "web"}
            items.append(body)
        self.created += [("service", ns, name) for name in names]
        listing = {"apiVersion": "v1", "kind": "List", "items": items}
        text = self.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(listing))
        got = list(json_objects(text))
        return [Change(o["metadata"]["name"], ns, o["spec"]["clusterIP"]) for o in got]

    def own_slice_service(self, name: str, namespace: str | None = None) -> Change:
        """A selectorless Service and an EndpointSlice the suite writes itself, on the backends'
        pods (ready): what reaches the agents does not wait for the controller-manager."""
        ns = namespace or self.env.app_ns
        change = self.service(name, namespace=ns, selector=False)
        pods = self.env.json("-n", self.env.app_ns, "get", "pods", "-l", "app=web")["items"]
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{name}-1",
                "namespace": ns,
                "labels": {
                    "kubernetes.io/service-name": name,
                    "endpointslice.kubernetes.io/managed-by": "chaos.kpx.dev",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [p["status"]["podIP"]], "conditions": {"ready": True}}
                for p in pods
                if p.get("status", {}).get("podIP")
            ],
        }
        self.kubectl("create", "-f", "-", input=json.dumps(slice_))
        self.created.append(("endpointslice", ns, f"{name}-1"))
        return change


def json_objects(text: str) -> Iterator[dict[str, Any]]:
    """The objects of `kubectl create -o json` (one per object created, one after another; a
    List's items when it prints a List)."""
    decoder, at = json.JSONDecoder(), 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return
        obj, at = decoder.raw_decode(text, at)
        yield from (obj["items"] if obj.get("kind") == "List" else [obj])


class Fault:
    """A fault: how it is injected, which nodes it touches, inject/hold/heal."""

    name = "fault"
    how = ""
    #: "inject": the changes are made right after the injection; "heal": right after the heal
    #: (the apiserver is away while the fault holds)
    change_at = "inject"
    #: the goal covers the touched nodes too (faults no packet should notice)
    strict = False
    #: the kpx mode the fault needs (None: any; the suite runs each row in its mode)
    mode: str | None = None

    def touches(self, env: MigrationEnv) -> list[Node]:
        return []

    def touches_label(self, env: MigrationEnv) -> str:
        nodes = self.touches(env)
        if not nodes:
            return "none"
        return "all" if len(nodes) == len(env.nodes) else ", ".join(n.name for n in nodes)

    def inject(self, ctx: Ctx) -> None:
        raise NotImplementedError

    def changes(self, ctx: Ctx) -> list[Change]:
        return [ctx.service(f"chaos-{ctx.run}")]

    def hold(self, ctx: Ctx) -> None:
        pass

    def heal(self, ctx: Ctx) -> None:
        pass

    def settled(self, ctx: Ctx) -> bool:
        """Besides every change answering everywhere: what convergence also needs."""
        return True

    def after(self, ctx: Ctx) -> None:
        """Once converged (or not): notes on what happened."""

    def cleanup(self, ctx: Ctx) -> None:
        """After the row, whatever happened (the heal may not have run)."""


@dataclass
class NotBuilt:
    name: str
    reason: str


def answers(netns: str, ip: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connection from netns `netns` to ip:port gets a line (an echo_server)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        sock = sim_netns.socket_in(netns, family)
    except OSError:
        return False
    try:
        sock.settimeout(timeout)
        sock.connect((ip, port))
        return bool(sock.recv(256))
    except OSError:
        return False
    finally:
        sock.close()


def unanswered(env: MigrationEnv, targets: Sequence[tuple[str, str, int]]) -> list[str]:
    """`targets`: (label, ip, port); the 'label@node' that no client netns got an answer from."""
    jobs = [(t, c) for t in targets for c in env.clients]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: answers(j[1].netns, j[0][1], j[0][2]), jobs))
    return [f"{t[0]}@{c.node.name}" for (t, c), ok in zip(jobs, got, strict=True) if not ok]


def base_targets(env: MigrationEnv) -> list[tuple[str, str, int]]:
    return [(n, env.service(n)["spec"]["clusterIP"], TCP_PORT) for n in ("svc-a", "svc-np")]


def healthy(env: MigrationEnv, timeout: float, log: Log, mode: str = "nftables") -> None:
    wait_until(lambda: env.rolled_out(mode), timeout, f"every agent in {mode} and the pxc Ready")
    targets = base_targets(env)
    wait_until(lambda: not unanswered(env, targets), timeout, "the Services answer everywhere")
    if clean_after(env, targets, timeout) is None:
        raise TimeoutError(f"new connections still fail somewhere after {timeout:.0f}s")


def converge(
    env: MigrationEnv,
    fault: Fault,
    ctx: Ctx,
    targets: Sequence[tuple[str, str, int]],
    opts: Options,
) -> tuple[float | None, list[str]]:
    """Seconds until every target answers from every node and the fault is settled (None:
    not within the timeout), and what did not answer."""
    t0 = time.monotonic()
    missing: list[str] = []

    def done() -> bool:
        missing[:] = unanswered(env, targets)
        if not missing and not fault.settled(ctx):
            missing.append(f"{fault.name}: not settled")
        return not missing

    try:
        wait_until(done, opts.converge_timeout, "every change answered everywhere")
    except TimeoutError:
        return None, missing
    return round(time.monotonic() - t0, 1), []


def repair(
    env: MigrationEnv,
    fault: Fault,
    ctx: Ctx,
    targets: Sequence[tuple[str, str, int]],
    opts: Options,
    log: Log,
) -> None:
    """After a row that did not converge: restart the agents of the nodes it touches (what an
    operator of the cluster would do), so the next rows start healthy; noted in the row."""
    nodes = fault.touches(env)
    if not nodes:
        return
    t0 = time.monotonic()
    for node in nodes:
        restart_agent(env, node)
    try:
        wait_until(lambda: not unanswered(env, targets), opts.converge_timeout, "repaired")
        took = f"everything answered {time.monotonic() - t0:.1f} s later"
    except TimeoutError:
        took = f"still not answered {opts.converge_timeout:.0f} s later"
    names = ", ".join(n.name for n in nodes)
    ctx.notes.append(f"to go on, the suite restarted the agent on {names}: {took}")
    log(f"   {ctx.notes[-1]}")
    clean = clean_after(env, targets, opts.converge_timeout)
    ctx.notes.append(
        f"then a round of {CLEAN_ROUND} new connections per node and Service all answered "
        + (
            f"{clean:.1f} s later"
            if clean is not None
            else f"not within {opts.converge_timeout:.0f} s"
        )
    )
    log(f"   {ctx.notes[-1]}")


#: new connections per client and target in one round of `clean_after`
CLEAN_ROUND = 40


def clean_after(
    env: MigrationEnv, targets: Sequence[tuple[str, str, int]], timeout: float
) -> float | None:
    """Seconds until a round of `CLEAN_ROUND` new connections from every node to every
    target all answer (None: not within `timeout`). A node repaired can still fail some new
    connections for a while; the next row must not count them."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not unanswered(env, list(targets) * CLEAN_ROUND):
            return round(time.monotonic() - t0, 1)
        time.sleep(1)
    return None


def run_row(env: MigrationEnv, fault: Fault | NotBuilt, opts: Options, log: Log) -> RowResult:
    if isinstance(fault, NotBuilt):
        return RowResult(fault.name, "", "", not_built=fault.reason)
    ctx = Ctx(env, opts, log)
    row = RowResult(fault.name, fault.how, fault.touches_label(env), strict=fault.strict)
    touched = [n.name for n in fault.touches(env)]
    started: list[Any] = []
    log(f"== {fault.name}: {fault.how}")
    try:
        healthy(env, opts.healthy_timeout, log, opts.mode)
        started = _start_load(env, opts.load)
        time.sleep(opts.load.warmup)
        changes: list[Change] = []
        t0 = time.monotonic()
        fault.inject(ctx)
        if fault.change_at == "inject":
            changes = ctx.changes = fault.changes(ctx)
        fault.hold(ctx)
        fault.heal(ctx)
        t_heal = time.monotonic()  # (a restarted apiserver: once it answers)
        log(f"   healed {t_heal - t0:.1f}s after the injection")
        if fault.change_at == "heal":
            changes = fault.changes(ctx)
        if fault.change_at != "after":
            row.changes = len(changes)
        targets = [(c.name, c.ip, c.port) for c in changes] + base_targets(env)
        row.converged, missing = converge(env, fault, ctx, targets, opts)
        log(
            f"   converged {row.converged}s after the heal"
            if row.converged is not None
            else f"   not converged after {opts.converge_timeout:.0f}s: {missing}"
        )
        fault.after(ctx)
        if fault.change_at == "after" and row.converged is not None:
            # kpx repaired on its own: now the change, which must reach every node too
            changes = fault.changes(ctx)
            row.changes = len(changes)
            targets = [(c.name, c.ip, c.port) for c in changes]
            took, missing = converge(env, fault, ctx, targets, opts)
            ctx.notes.append(
                f"the change made after the repair answered everywhere {took} s later"
                if took is not None
                else "the change made after the repair never answered everywhere"
            )
        if missing:
            ctx.notes.append(
                f"not answered {opts.converge_timeout:.0f} s after the heal: "
                f"{', '.join(missing[:8])}"
            )
            base = ("svc-a@", "svc-np@")
            row.lost = [m for m in missing if "@" in m and not m.startswith(base)]
            repair(env, fault, ctx, targets, opts, log)
        time.sleep(opts.settle)
    except Exception as err:  # the row records it, the suite goes on
        row.error = f"{type(err).__name__}: {err}"
        log(traceback.format_exc())
    finally:
        if started:
            loads = _stop_load(started, opts.load.timeout)
            addresses = {n.ipv4: n.name for n in env.nodes} | {n.ipv6: n.name for n in env.nodes}
            nodes = [c.node.name for c in env.clients]
            row.traffic = account(zip(nodes, loads, strict=True), touched, addresses)
        try:
            fault.cleanup(ctx)
        except Exception as err:
            row.error = row.error or f"cleanup: {type(err).__name__}: {err}"
        for kind, ns, name in reversed(ctx.created):
            env.cluster.kubectl(
                "-n", ns, "delete", kind, name, "--ignore-not-found", "--wait=false", check=False
            )
        row.notes = ctx.notes + row.notes
    t = row.traffic
    if t is not None:
        log(f"   tcp {t.tcp} udp {t.udp}; {'; '.join(row.problems()) or 'goal met'}")
    return row
