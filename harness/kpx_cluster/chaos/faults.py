"""The faults of the table (docs/chaos.md says what each proves).

`pod_pids` finds a container's processes (on real kubelets: its cgroup's; on the node
simulator: the descendants of its `runc run`), which is what a SIGKILL or SIGSTOP of a
kubelet's container reaches. Kernel faults run `nft` inside one node's netns through the
topology, never in the host's.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from typing import Any

from kpx_cluster.migration import NS, MigrationEnv, wait_until
from kpx_cluster.netns import Node

from .procs import RESTART_TIMEOUT, agent_pod, pod_pids, restart_count, signal_all
from .runner import Change, Ctx, Fault, answers

OPERATOR_LABEL = "app.kubernetes.io/name=kpx-operator"


# ---- agents -------------------------------------------------------------------------------


class AgentKill(Fault):
    """SIGKILL the agent's processes on one node (or all at once); the kubelet restarts the
    container. `times` > 1: killed again each time it is back (a container the OOM killer
    kills in a loop: the same SIGKILL, without the memory pressure), so a real kubelet's
    CrashLoopBackOff spaces the restarts out."""

    strict = True  # the kernel keeps the rules: no packet may notice

    def __init__(self, which: str = "one", times: int = 1) -> None:
        self.which, self.times = which, times
        if times > 1:
            self.name = f"agent OOM-killed in a loop ({times}x, one node)"
            self.how = (
                f"SIGKILL of the agent container's processes, again as soon as it is "
                f"restarted, {times} times"
            )
        else:
            self.name = f"agent SIGKILL, {'one node' if which == 'one' else 'all nodes at once'}"
            self.how = "SIGKILL of the agent container's processes, the kubelet restarts it"

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[1:2] if self.which == "one" else list(env.nodes)

    def settled(self, ctx: Ctx) -> bool:
        return ctx.env.rolled_out(ctx.opts.mode)

    def _kill(self, ctx: Ctx) -> list[tuple[str, int]]:
        killed = []
        for node in self.touches(ctx.env):
            pod = agent_pod(ctx.env, node)
            before = restart_count(ctx.env, NS, pod)
            pids = pod_pids(ctx.env, NS, pod)
            if not pids:
                raise RuntimeError(f"no process of {pod}")
            signal_all(pids, signal.SIGKILL)
            killed.append((pod, before))
        return killed

    def inject(self, ctx: Ctx) -> None:
        self.killed = self._kill(ctx)

    def hold(self, ctx: Ctx) -> None:
        t0 = time.monotonic()
        for i in range(self.times):
            for pod, before in self.killed:
                wait_until(
                    lambda p=pod, b=before: (
                        restart_count(ctx.env, NS, p) > b  # type: ignore[misc]
                        and pod_pids(ctx.env, NS, p)
                    ),
                    RESTART_TIMEOUT,
                    f"{pod} restarted",
                )
            if i + 1 < self.times:
                self.killed = self._kill(ctx)
        ctx.notes.append(
            f"agent restarted {self.times} time(s) on {self.touches_label(ctx.env)}, "
            f"the last {time.monotonic() - t0:.0f} s after the first kill"
        )


# ---- control plane ------------------------------------------------------------------------


class ApiserverDown(Fault):
    """The apiserver stopped; at its return two Services are created: one whose EndpointSlice
    the controller-manager writes (what users see) and one whose slice the suite writes itself
    (what kpx alone takes). Each is timed from its creation, and the controller-manager's slice
    too: after an outage its reflectors back off before they list again, which kpx cannot
    shorten."""

    name = "apiserver stopped 60 s"
    change_at = "heal"
    strict = True

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self.how = (
            f"kube-apiserver SIGTERM, started again after {seconds:.0f} s; a Service "
            "created the moment it answers"
        )
        self.argv: list[str] = []
        self.watch: Stopwatch | None = None

    def inject(self, ctx: Ctx) -> None:
        self.argv = ctx.env.cluster.stop_component("kube-apiserver")

    def hold(self, ctx: Ctx) -> None:
        time.sleep(ctx.seconds(self.seconds))

    def heal(self, ctx: Ctx) -> None:
        if self.argv:
            ctx.env.cluster.start_component("kube-apiserver", self.argv)
            self.argv = []

    def changes(self, ctx: Ctx) -> list[Change]:
        managed = ctx.service(f"chaos-{ctx.run}")
        own = ctx.own_slice_service(f"chaos-{ctx.run}-own")
        self.watch = Stopwatch(ctx, managed, own)
        return [managed, own]

    def after(self, ctx: Ctx) -> None:
        if self.watch is not None:
            ctx.notes.append(self.watch.stop())

    def cleanup(self, ctx: Ctx) -> None:
        self.heal(ctx)
        if self.watch is not None:
            self.watch.stop()


class Stopwatch:
    """From its start (the two Services' creation, right after the heal): when `own` answers
    from every node, when the
    controller-manager's EndpointSlice of `managed` has an endpoint, and when `managed`
    answers from every node."""

    def __init__(self, ctx: Ctx, managed: Change, own: Change) -> None:
        self.ctx, self.managed, self.own = ctx, managed, own
        self.t0 = time.monotonic()
        self.seen: dict[str, float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _slice_written(self) -> bool:
        got = self.ctx.env.json(
            "-n",
            self.managed.namespace,
            "get",
            "endpointslices",
            "-l",
            f"kubernetes.io/service-name={self.managed.name}",
        )
        return any(s.get("endpoints") for s in got.get("items", []))

    def _everywhere(self, change: Change) -> bool:
        return all(answers(c.netns, change.ip, change.port) for c in self.ctx.env.clients)

    def _run(self) -> None:
        checks = {
            "own": lambda: self._everywhere(self.own),
            "slice": self._slice_written,
            "managed": lambda: self._everywhere(self.managed),
        }
        while not self.done.is_set() and len(self.seen) < len(checks):
            for key, check in checks.items():
                if key not in self.seen and check():
                    self.seen[key] = time.monotonic() - self.t0
            self.done.wait(0.25)

    def stop(self) -> str:
        self.done.set()
        self.thread.join()

        def at(key: str) -> str:
            return f"{self.seen[key]:.1f} s" if key in self.seen else "not seen"

        return (
            f"from their creation: the Service whose EndpointSlice the suite wrote answered "
            f"everywhere after {at('own')}; the controller-manager wrote the other's "
            f"EndpointSlice after {at('slice')}, and it answered everywhere after "
            f"{at('managed')}"
        )


class CompactionBurst(Fault):
    """`count` Services created in one burst while etcd is compacted every 0.2 s; then the
    apiserver restarted after one more compaction (its watch cache starts again from etcd's
    head, older revisions compacted away: watches resuming from before it may get 410). Whether
    an agent's watch got 410 is not observed: its reflector lists again without a log line."""

    strict = True

    def __init__(self, count: int = 60) -> None:
        self.count = count
        self.name = "etcd compaction during a burst"
        self.how = (
            f"{count} Services created in one burst, etcd compacted to its head every 0.2 s "
            "meanwhile, then the apiserver restarted"
        )
        self.compactions = 0
        self.stop = threading.Event()
        self.argv: list[str] = []

    def _compact(self, ctx: Ctx) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                ctx.env.cluster.compact_etcd()
                self.compactions += 1
            self.stop.wait(0.2)

    def inject(self, ctx: Ctx) -> None:
        self.thread = threading.Thread(target=self._compact, args=(ctx,), daemon=True)
        self.thread.start()

    def changes(self, ctx: Ctx) -> list[Change]:
        return ctx.services([f"burst-{ctx.run}-{i}" for i in range(self.count)])

    def heal(self, ctx: Ctx) -> None:
        time.sleep(0.5)
        self.argv = ctx.env.cluster.stop_component("kube-apiserver")
        self.stop.set()
        self.thread.join()
        with contextlib.suppress(OSError):  # 400: no write since the last compaction
            ctx.env.cluster.compact_etcd()
            self.compactions += 1
        ctx.env.cluster.start_component("kube-apiserver", self.argv)
        self.argv = []

    def after(self, ctx: Ctx) -> None:
        ctx.notes.append(f"{self.compactions} compactions, then the apiserver restarted")
        if self.compactions == 0:  # the fault was not injected: the row proves nothing
            raise RuntimeError("no compaction of etcd succeeded")

    def cleanup(self, ctx: Ctx) -> None:
        self.stop.set()
        if self.argv:
            ctx.env.cluster.start_component("kube-apiserver", self.argv)
            self.argv = []


# ---- one node's network and kernel ---------------------------------------------------------


def kpx_tables(ctx: Ctx, node: Node) -> list[tuple[str, str]]:
    out = ctx.env.topo.exec(node, ["nft", "list", "tables"], check=True).stdout
    return [
        (w[1], w[2])
        for w in (line.split() for line in out.splitlines())
        if len(w) == 3 and w[2] == "kpx"
    ]


def apiserver_port(env: MigrationEnv) -> int:
    """The port a node's agent and kubelet dial the apiserver on (the simulator relays it)."""
    if env.real_nodes:
        return int(env.cluster.cluster_server.rsplit(":", 1)[1])
    return env.simulator().apiserver_port


class ApiserverDropped(Fault):
    """One node's packets to and from the apiserver dropped (nft in that node's netns): its
    agent's and, on real kubelets, its kubelet's, as in a partition of the node."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self.name = "one node's packets to the apiserver dropped 60 s"
        self.how = (
            f"nft table `inet chaos` in the node's netns drops TCP to and from the "
            f"apiserver's port (output and input hooks) for {seconds:.0f} s"
        )

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[2:3]

    def inject(self, ctx: Ctx) -> None:
        port = apiserver_port(ctx.env)
        # Both hooks: what the node sends (output) and what it receives (input: a watch's
        # events arrive there even while the node's ACKs are dropped).
        chains = "".join(
            f" chain {hook} {{\n  type filter hook {hook} priority -300;\n"
            f"  tcp dport {port} drop\n  tcp sport {port} drop\n }}\n"
            for hook in ("output", "input")
        )
        rules = f"table inet chaos {{\n{chains}}}\n"
        ctx.env.topo.exec(self.touches(ctx.env)[0], ["nft", "-f", "-"], input=rules, check=True)

    def hold(self, ctx: Ctx) -> None:
        """Meanwhile: when the change answers on the other nodes, and whether on the cut-off
        one (it should not: its agent cannot hear of it)."""
        t0 = time.monotonic()
        end = t0 + ctx.seconds(self.seconds)
        cut = self.touches(ctx.env)[0]
        others = [c for c in ctx.env.clients if c.node != cut]
        mine = next(c for c in ctx.env.clients if c.node == cut)
        seen: float | None = None
        leaked = False
        while time.monotonic() < end:
            ok = all(answers(c.netns, ch.ip, ch.port) for c in others for ch in ctx.changes)
            if ok and seen is None:
                seen = time.monotonic() - t0
            leaked = leaked or all(answers(mine.netns, ch.ip, ch.port) for ch in ctx.changes)
            time.sleep(1)
        ctx.notes.append(
            (
                f"the change answered on the other nodes {seen:.1f} s after it was made"
                if seen is not None
                else "the change did not answer on the other nodes meanwhile"
            )
            + f"; on {cut.name}: {'it did (!)' if leaked else 'not before the heal'}"
        )

    def heal(self, ctx: Ctx) -> None:
        ctx.env.topo.exec(self.touches(ctx.env)[0], ["nft", "delete", "table", "inet", "chaos"])

    def cleanup(self, ctx: Ctx) -> None:
        self.heal(ctx)


class NftFlush(Fault):
    name = "foreign `nft flush table` (one node)"
    change_at = "after"
    mode = "nftables"

    def __init__(self) -> None:
        self.how = "`nft flush table` of every kpx table in one node's netns"

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[0:1]

    def inject(self, ctx: Ctx) -> None:
        node = self.touches(ctx.env)[0]
        tables = kpx_tables(ctx, node)
        if not tables:
            raise RuntimeError(f"no kpx table on {node.name}")
        for family, name in tables:
            ctx.env.topo.exec(node, ["nft", "flush", "table", family, name], check=True)
        ctx.notes.append("flushed " + ", ".join(f"{f} {n}" for f, n in tables))


class IptablesFlush(Fault):
    """`iptables -F` as a person runs it by mistake: every chain of the filter and nat tables
    flushed, IPv4 and IPv6, in one node's netns (kpx's own chains and the hooks' jumps into
    them, and whatever else was there). The agent's periodic check (a digest of its chains)
    must notice and write everything again."""

    name = "foreign `iptables -F` (one node)"
    change_at = "after"
    mode = "iptables"
    TABLES = ("filter", "nat")

    def __init__(self) -> None:
        self.how = (
            "`iptables -F` and `iptables -t nat -F` (and ip6tables') in one node's netns: "
            "every chain of both tables flushed"
        )

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[0:1]

    def inject(self, ctx: Ctx) -> None:
        node = self.touches(ctx.env)[0]
        flushed = []
        for tool in ("iptables", "ip6tables"):
            for table in self.TABLES:
                before = ctx.env.topo.exec(node, [f"{tool}-save", "-t", table], check=True)
                rules = sum(line.startswith("-A ") for line in before.stdout.splitlines())
                ctx.env.topo.exec(node, [tool, "-t", table, "-F"], check=True)
                flushed.append(f"{tool} {table} ({rules} rules)")
        ctx.notes.append("flushed " + ", ".join(flushed))


def _elem_key(elem: Any) -> str:
    key = elem[0] if isinstance(elem, list) else elem
    if isinstance(key, dict) and "elem" in key:
        key = key["elem"]["val"]
    if isinstance(key, dict) and "concat" in key:
        return " . ".join(str(k) for k in key["concat"])
    return str(key)


class NftElementDeleted(Fault):
    name = "one nft element deleted (one node)"
    change_at = "after"
    mode = "nftables"

    def __init__(self) -> None:
        self.how = (
            "`nft delete element` of svc-a's ClusterIP entries (service-ips) in one node's netns"
        )

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[0:1]

    def inject(self, ctx: Ctx) -> None:
        node = self.touches(ctx.env)[0]
        ip = ctx.env.service("svc-a")["spec"]["clusterIP"]
        for family, table in kpx_tables(ctx, node):
            if family != "ip":
                continue
            raw = ctx.env.topo.exec(
                node, ["nft", "-j", "list", "table", family, table], check=True
            ).stdout
            # the verdict map that dispatches a ClusterIP to its Service's chain (service-ips)
            # first: deleting a set's element (the masquerade marks) would break nothing
            maps = [o["map"] for o in json.loads(raw)["nftables"] if "map" in o]
            maps.sort(key=lambda m: m["name"] != "service-ips")
            for body in maps:
                keys = [k for k in map(_elem_key, body.get("elem", [])) if ip in k.split(" . ")]
                if not keys:
                    continue
                what = f"{family} {table} {body['name']} {{ {', '.join(keys)} }}"
                ctx.env.topo.exec(node, ["nft", "delete", "element", *what.split()], check=True)
                ctx.notes.append(f"deleted `{what}`")
                return
        raise RuntimeError(f"no element naming {ip} on {node.name}")


# ---- objects ------------------------------------------------------------------------------


class PoisonPair(Fault):
    name = "the poison pair"
    how = (
        "two LoadBalancer Services, same LB IP and port, sourceRanges 10.0.0.0/8 and "
        "10.1.0.0/16; then an unrelated Service"
    )
    strict = True

    def inject(self, ctx: Ctx) -> None:
        for i, cidr in enumerate(("10.0.0.0/8", "10.1.0.0/16")):
            name = f"poison-{ctx.run}-{i}"
            ctx.service(name, type="LoadBalancer", loadBalancerSourceRanges=[cidr])
            status = {"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.77"}]}}}
            ctx.kubectl(
                "-n",
                ctx.env.app_ns,
                "patch",
                "svc",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps(status),
            )
        time.sleep(2)  # the pair reaches the agents before the unrelated Service


class OptOutFlap(Fault):
    """A namespace's opt-out label set and removed every second."""

    strict = True

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.name = "namespace opt-out flapping every second"
        self.how = (
            f"label networking.k8s.io/kube-proxy=disabled on a namespace set and removed "
            f"every second for {seconds:.0f} s, ending removed"
        )

    def changes(self, ctx: Ctx) -> list[Change]:
        ns = f"chaos-flap-{ctx.run}"
        self.ns = ns
        ctx.kubectl("create", "namespace", ns)
        ctx.created.append(("namespace", "", ns))
        change = ctx.own_slice_service("flap", namespace=ns)
        return [change, ctx.service(f"chaos-{ctx.run}")]

    def inject(self, ctx: Ctx) -> None:
        pass

    def hold(self, ctx: Ctx) -> None:
        end = time.monotonic() + ctx.seconds(self.seconds)
        flips = 0
        while time.monotonic() < end:
            value = (
                "networking.k8s.io/kube-proxy=disabled"
                if flips % 2 == 0
                else ("networking.k8s.io/kube-proxy-")
            )
            ctx.kubectl("label", "namespace", self.ns, value, "--overwrite")
            flips += 1
            time.sleep(1)
        ctx.kubectl("label", "namespace", self.ns, "networking.k8s.io/kube-proxy-", check=False)
        ctx.notes.append(f"{flips} label flips")


class PxcDeleted(Fault):
    name = "ProxyConfiguration deleted"
    how = "`kubectl delete pxc`, applied again 10 s after it is gone"

    def __init__(self, seconds: float = 10.0) -> None:
        self.seconds = seconds
        self.saved: dict[str, Any] = {}

    def touches(self, env: MigrationEnv) -> list[Node]:
        return list(env.nodes)

    def inject(self, ctx: Ctx) -> None:
        pxc = ctx.env.json("get", "pxc", ctx.env.pxc)
        self.saved = {
            "apiVersion": pxc["apiVersion"],
            "kind": pxc["kind"],
            "metadata": {"name": ctx.env.pxc},
            "spec": pxc["spec"],
        }
        t0 = time.monotonic()
        ctx.env.cluster.kubectl("delete", "pxc", ctx.env.pxc, "--timeout=150s", timeout=180)
        ctx.notes.append(f"deletion took {time.monotonic() - t0:.1f} s")

    def hold(self, ctx: Ctx) -> None:
        time.sleep(ctx.seconds(self.seconds))
        rules = {n.name: bool(kpx_tables(ctx, n)) for n in ctx.env.nodes}
        ctx.notes.append(
            "kpx tables while deleted: "
            + ", ".join(f"{n} {'kept' if r else 'gone'}" for n, r in rules.items())
        )

    def heal(self, ctx: Ctx) -> None:
        if self.saved:
            ctx.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(self.saved))
            self.saved = {}

    def settled(self, ctx: Ctx) -> bool:
        return ctx.env.rolled_out(ctx.opts.mode)

    def cleanup(self, ctx: Ctx) -> None:
        self.heal(ctx)


class OperatorLeader(Fault):
    """The operator's leader SIGKILLed (or SIGSTOPped `seconds`) right after a change that
    rolls the agents' DaemonSet (spec.resources.requests.cpu)."""

    strict = True

    def __init__(self, sig: str = "kill", seconds: float = 30.0) -> None:
        self.sig, self.seconds = sig, seconds
        verb = "SIGKILLed" if sig == "kill" else f"SIGSTOPped {seconds:.0f} s"
        self.name = f"operator leader {verb} mid-rollout"
        self.how = (
            f"spec.resources.requests.cpu changed (the agents roll), then the Lease "
            f"holder's processes {verb}"
        )
        self.pids: list[int] = []

    def _leader(self, ctx: Ctx) -> str:
        lease = ctx.env.json("-n", NS, "get", "lease", "kpx-operator")
        holder = str(lease.get("spec", {}).get("holderIdentity") or "")
        return holder.rsplit("_", 1)[0]

    def inject(self, ctx: Ctx) -> None:
        pxc = ctx.env.json("get", "pxc", ctx.env.pxc)
        cpu = pxc["spec"].get("resources", {}).get("requests", {}).get("cpu", "50m")
        self.cpu = "51m" if cpu != "51m" else "52m"
        self.generation = int(pxc["metadata"]["generation"]) + 1
        leader = self._leader(ctx)
        ctx.kubectl(
            "patch",
            "pxc",
            ctx.env.pxc,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"resources": {"requests": {"cpu": self.cpu}}}}),
        )
        time.sleep(1)
        self.pids = pod_pids(ctx.env, NS, leader)
        if not self.pids:
            raise RuntimeError(f"no process of the leader {leader}")
        sig = signal.SIGKILL if self.sig == "kill" else signal.SIGSTOP
        signal_all(self.pids, sig)
        ctx.notes.append(f"leader {leader} {self.sig} 1 s after the patch")

    def hold(self, ctx: Ctx) -> None:
        if self.sig == "stop":
            time.sleep(ctx.seconds(self.seconds))

    def heal(self, ctx: Ctx) -> None:
        if self.sig == "stop" and self.pids:
            signal_all(self.pids, signal.SIGCONT)
            self.pids = []

    def settled(self, ctx: Ctx) -> bool:
        pods = ctx.env.agent_pods()
        cpus = {
            c.get("resources", {}).get("requests", {}).get("cpu")
            for p in pods
            for c in p["spec"]["containers"]
        }
        st = ctx.env.json("get", "pxc", ctx.env.pxc).get("status", {})
        return (
            cpus == {self.cpu}
            and ctx.env.rolled_out(ctx.opts.mode)
            and int(st.get("observedGeneration", 0)) >= self.generation
        )

    def cleanup(self, ctx: Ctx) -> None:
        self.heal(ctx)


class NodeReboot(Fault):
    """A node's reboot, as far as the kernel's state goes: its agent frozen (SIGSTOP), the
    node netns's whole ruleset flushed and its conntrack table emptied, then the agent
    SIGKILLed (the kubelet starts it again). No kube-proxy runs on the node: only kpx can put
    the rules back. Not reproduced: the node's pods and its kubelet keep running."""

    name = "node reboot (rules wiped, kube-proxy gone)"
    how = (
        "agent SIGSTOPped, `nft flush ruleset` and `conntrack -F` in the node's netns, agent "
        "SIGKILLed and restarted"
    )

    def touches(self, env: MigrationEnv) -> list[Node]:
        return env.nodes[1:2]

    def inject(self, ctx: Ctx) -> None:
        node = self.touches(ctx.env)[0]
        pod = agent_pod(ctx.env, node)
        self.pod, self.before = pod, restart_count(ctx.env, NS, pod)
        pids = pod_pids(ctx.env, NS, pod)
        signal_all(pids, signal.SIGSTOP)
        try:
            ctx.env.topo.exec(node, ["nft", "flush", "ruleset"], check=True)
            ctx.env.topo.exec(node, ["conntrack", "-F"])
        finally:
            signal_all(pids, signal.SIGKILL)

    def hold(self, ctx: Ctx) -> None:
        wait_until(
            lambda: restart_count(ctx.env, NS, self.pod) > self.before,
            RESTART_TIMEOUT,
            f"{self.pod} restarted",
        )

    def settled(self, ctx: Ctx) -> bool:
        return ctx.env.rolled_out(ctx.opts.mode)


class ObjectBomb(Fault):
    """One selectorless Service with `ports` ports and `endpoints` endpoints (EndpointSlices
    of 1000, addresses nobody answers on: no traffic goes to it), then an unrelated Service."""

    strict = True

    def __init__(self, endpoints: int = 2000, ports: int = 50) -> None:
        self.endpoints, self.ports = endpoints, ports
        self.name = "object bomb"
        self.how = (
            f"one Service with {ports} ports and {endpoints} endpoints "
            f"({ports * endpoints} endpoint-ports), then an unrelated Service"
        )

    def inject(self, ctx: Ctx) -> None:
        ns, name = ctx.env.app_ns, f"bomb-{ctx.run}"
        ports = [
            {"name": f"p{i}", "port": 10000 + i, "targetPort": 20000 + i, "protocol": "TCP"}
            for i in range(self.ports)
        ]
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"ports": ports},
        }
        ctx.kubectl("create", "-f", "-", input=json.dumps(svc))
        ctx.created.append(("service", ns, name))
        items = []
        for s in range(0, self.endpoints, 1000):
            addresses = [
                f"10.250.{i // 250}.{i % 250 + 1}" for i in range(s, min(s + 1000, self.endpoints))
            ]
            items.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{name}-{s // 1000}",
                        "namespace": ns,
                        "labels": {
                            "kubernetes.io/service-name": name,
                            "endpointslice.kubernetes.io/managed-by": "chaos.kpx.dev",
                        },
                    },
                    "addressType": "IPv4",
                    "ports": [
                        {"name": f"p{i}", "port": 20000 + i, "protocol": "TCP"}
                        for i in range(self.ports)
                    ],
                    "endpoints": [
                        {"addresses": [a], "conditions": {"ready": True}} for a in addresses
                    ],
                }
            )
            ctx.created.append(("endpointslice", ns, f"{name}-{s // 1000}"))
        ctx.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )
        time.sleep(2)  # the bomb reaches the agents before the unrelated Service
