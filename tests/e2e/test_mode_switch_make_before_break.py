"""Issue #18, switching modes on a node, make-before-break: real agents, a real apiserver, real
packets in network namespaces.

An agent of the old mode serves a ClusterIP on n1 (two ports: one answered by the echo servers
b1/b2 and closed at once, one by a server that keeps each connection open). A client in a pod
on n1 opens a new TCP connection every 10 ms, and one long-lived connection exchanges a line
every 100 ms. The old agent stops (its rules stay, as on a rollout), the new mode's agent
starts: it programs its own rules, verifies them, and only then removes the old mode's. No try
may fail, the long-lived connection must keep answering, and nothing of the old mode remains.
(An agent that removed the other modes' rules at its start, before its first sync, fails this:
the node then has no rules for as long as its first lists and sync take.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from agent_harness import (
    BACKEND_PORT,
    AgentEnv,
    TrafficWatch,
    build_agent_env,
    endpoint_slice,
    iptables_chains,
    kpx_tables,
    service,
    service_port,
    wait_until,
    write_agent_config,
)

from kpx_cluster.controlplane import Cluster
from kpx_cluster.netns import Pod, Topology

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

HOLD_PORT = 7070  # the long-lived connections' backends
HOLD_SERVICE_PORT = 81
BOTH = {"b1", "b2"}

# A backend that keeps connections open: each line received is answered with "<name> <line>".
HOLD_SERVER = """
import socket, sys, threading
name, port = sys.argv[1], int(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", port))
srv.listen(16)
def serve(conn):
    with conn, conn.makefile("rwb") as f:
        for line in f:
            f.write(name.encode() + b" " + line)
            f.flush()
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# One connection held open: a line every 100 ms; prints "ok <backend>" per answer, or
# "fail <why>" and exits 1 when the connection breaks.
HOLD_CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:  # until the rules of this port are in
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
f = s.makefile("rwb")
i = 0
while True:
    try:
        f.write(b"ping %d\\n" % i)
        f.flush()
        answer = f.readline().decode().split()
        if len(answer) != 3 or answer[2] != str(i):
            raise OSError(f"bad answer {answer}")
    except OSError as exc:
        print("fail", exc, flush=True)
        sys.exit(1)
    print("ok", answer[0], flush=True)
    i += 1
    time.sleep(0.1)
"""


@dataclass
class Holder:
    proc: subprocess.Popen[str]

    @classmethod
    def start(cls, topology: Topology, pod: Pod, vip: str) -> Holder:
        argv = [sys.executable, "-c", HOLD_CLIENT, vip, str(HOLD_SERVICE_PORT)]
        proc = topology.run(pod, argv, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("ok "), first
        return cls(proc)

    def finish(self) -> list[str]:
        """Stop it and return its lines (it must still have been running)."""
        alive = self.proc.poll() is None
        if alive:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=10)
        lines = out.splitlines()
        assert alive, f"the long-lived connection broke: {lines[-3:]}"
        return lines


@pytest.fixture(
    params=[("iptables", "nftables"), ("nftables", "iptables")],
    ids=["iptables-to-nftables", "nftables-to-iptables"],
)
def switch(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[tuple[AgentEnv, str]]:
    old, new = request.param
    with build_agent_env(cluster, old) as env:
        for name in ("b1", "b2"):
            argv = [sys.executable, "-c", HOLD_SERVER, name, str(HOLD_PORT)]
            env.topology.run_ready(env.pods[name], argv)
        yield env, new


def old_rules_left(env: AgentEnv, mode: str) -> set[str]:
    if mode == "iptables":
        return iptables_chains(env.topology, env.n1)
    return kpx_tables(env.topology, env.n1)


def test_new_mode_takes_over_without_a_failed_connection(
    switch: tuple[AgentEnv, str], agent_ns: str
) -> None:
    env, new_mode = switch
    old_mode = env.mode
    ports = [
        service_port("tcp", 80, BACKEND_PORT),
        service_port("hold", HOLD_SERVICE_PORT, HOLD_PORT),
    ]
    env.kube.apply(
        service("web", agent_ns, ports),
        endpoint_slice(
            "web-v4",
            agent_ns,
            "web",
            env.backend_endpoints(4),
            [("tcp", BACKEND_PORT, "TCP"), ("hold", HOLD_PORT, "TCP")],
        ),
    )
    vip = env.kube.get("service", "web", agent_ns)["spec"]["clusterIP"]
    wait_until(
        lambda: env.probe(vip, 80, count=6, timeout=0.5).backends == BOTH,
        15,
        message="the old mode never served the Service",
    )
    assert old_rules_left(env, old_mode), f"mode {old_mode} programmed nothing?"

    holder = Holder.start(env.topology, env.client, vip)
    watch = TrafficWatch.start(env.topology, env.client, vip, 80)
    try:
        t0 = time.time()
        time.sleep(0.5)
        old = env.agent
        assert old is not None
        old.stop()  # SIGTERM: its rules stay in the kernel, as during a rollout
        config = write_agent_config(env.topology.tmpdir / f"{new_mode}.yaml", new_mode)
        new = env.start_agent("n1", mode=new_mode, config=config)
        wait_until(
            lambda: not old_rules_left(env, old_mode),
            15,
            0.1,
            message=lambda: f"{old_mode} rules stay:\n{new.log_tail()}",
        )
        t_removed = time.time()
        # Traffic keeps flowing on the new mode's rules alone.
        watch.wait_for(lambda ev: ev[-1][0] if ev and ev[-1][0] > t_removed + 1 else None, 10)
    finally:
        watch.stop()
        lines = holder.finish()
    tries = watch.since(t0)
    failures = [e for e in tries if e[1] not in BOTH]
    print(
        f"{old_mode} -> {new_mode}: {len(tries)} tries over {tries[-1][0] - tries[0][0]:.1f}s, "
        f"{len(failures)} failed; held connection: {len(lines)} exchanges"
    )
    assert len(tries) > 100, f"too few tries to tell: {len(tries)}"
    assert not failures, f"{len(failures)} of {len(tries)} tries failed: {failures[:10]}"
    assert lines and all(line.startswith("ok ") for line in lines), lines[-5:]
    assert len({line.split()[1] for line in lines}) == 1, "the held connection changed backend"
    assert len(lines) > 10, lines
    # The new agent's own rules are in, the old mode's are gone, and it says so.
    assert old_rules_left(env, new_mode), f"mode {new_mode} has no rules"
    assert new.metric("kpx_leftovers_pending", leftovers=old_mode) == 0
    log = new.log()
    assert log.index("first sync verified") < log.index(f"removed the rules of kpx mode {old_mode}")
    # 30 fresh connections: with 2 random endpoints, all on one happens 2 in 2**30 runs (10
    # tries put every one on b1 in a CI run).
    fresh = env.probe(vip, 80, count=30, timeout=1.0)
    assert fresh.failed == 0 and fresh.backends == BOTH, fresh
