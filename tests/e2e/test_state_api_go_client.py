"""The state API from another language: the Go example client (examples/plugins/go-localstate,
built on the code generated from the .proto) watches a real agent in mode external with deltas
while Services and EndpointSlices are created, updated and deleted on the session's real
apiserver; its local copy then equals, message for message, a fresh full state. The agent runs
from its command line alone (no configuration file); a malformed request gets INVALID_ARGUMENT;
a socket path in a shared directory is refused and the directory left as it was, and an
existing private one keeps its mode."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_harness import (
    AgentEnv,
    build_agent_env,
    endpoint,
    endpoint_slice,
    service,
    service_port,
    wait_until,
)
from google.protobuf import json_format

from kpx_cluster.controlplane import Cluster
from kpx_localstate_client import CHANNEL_OPTIONS, WATCH_METHOD, PortKey
from kpx_localstate_client import localstate_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

REPO = Path(__file__).resolve().parents[2]
GO_CLIENT = REPO / "examples" / "plugins" / "go-localstate"


@pytest.fixture(scope="module")
def go_client() -> Path:
    """The client's binary, built with the machine's Go into the cache (nothing when cached)."""
    out = subprocess.run(
        [str(REPO / "toolchain" / "build-go-localstate.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    binary = Path(out.strip().splitlines()[-1].split(": ", 1)[1])
    assert os.access(binary, os.X_OK), out
    return binary


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[AgentEnv]:
    with build_agent_env(cluster, "external", start=False) as shared:
        yield shared


@pytest.fixture(scope="module")
def socket_path(env: AgentEnv) -> Path:
    """The agent on n1 from its command line only: `--mode external --state-socket PATH`."""
    path = env.topology.tmpdir / "go" / "state.sock"
    agent = env.start_agent("n1", config=None, extra_args=["--state-socket", str(path)])
    assert "--config" not in agent.argv
    return path


def fresh_full(path: Path) -> pb.WatchResponse:
    """A full state, as a new client without deltas gets it."""
    with grpc.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS) as channel:
        watch = channel.stream_stream(
            WATCH_METHOD,
            request_serializer=pb.WatchRequest.SerializeToString,
            response_deserializer=pb.WatchResponse.FromString,
        )
        response: pb.WatchResponse = next(iter(watch(iter([pb.WatchRequest()]), timeout=10)))
    assert response.full
    return response


def read_dump(path: Path) -> pb.WatchResponse | None:
    try:
        return json_format.Parse(path.read_text(), pb.WatchResponse())
    except (OSError, json_format.ParseError):
        return None


def ports_of(response: pb.WatchResponse) -> dict[PortKey, pb.ServicePort]:
    return {PortKey.of(p.key): p for p in response.service_ports}


def differences(copy: pb.WatchResponse, fresh: pb.WatchResponse) -> list[str]:
    """What differs between the Go client's copy and a fresh full state (empty: equal)."""
    out = [
        name
        for name in ("instance_id", "revision", "node", "settings", "node_facts")
        if getattr(copy, name) != getattr(fresh, name)
    ]
    mine, theirs = ports_of(copy), ports_of(fresh)
    out += [f"only in the copy: {k}" for k in mine.keys() - theirs.keys()]
    out += [f"missing from the copy: {k}" for k in theirs.keys() - mine.keys()]
    out += [f"differs: {k}" for k in mine.keys() & theirs.keys() if mine[k] != theirs[k]]
    return out


def test_the_agent_runs_mode_external_from_its_command_line(socket_path: Path) -> None:
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o750  # created by the agent


def test_generated_go_code_is_fresh() -> None:
    result = subprocess.run(
        [str(GO_CLIENT / "generate.sh"), "--check"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_go_client_copy_equals_a_fresh_full_state_after_changes(
    env: AgentEnv, socket_path: Path, go_client: Path, agent_ns: str
) -> None:
    work = env.topology.tmpdir / "go-client"
    work.mkdir(exist_ok=True)
    dump, stdout, log = work / "state.json", work / "stdout.json", work / "client.log"
    with stdout.open("wb") as out, log.open("wb") as err:
        proc = subprocess.Popen(
            [str(go_client), "-target", f"unix://{socket_path}", "-dump", str(dump)],
            stdout=out,
            stderr=err,
        )
    ns = agent_ns
    b1, b2 = env.pods["b1"], env.pods["b2"]
    tcp, udp = ("http", 8080, "TCP"), ("dns", 5353, "UDP")
    a_ports = [service_port("http", 80, 8080), service_port("dns", 53, 5353, "UDP")]

    def a_slice(ready: bool, terminating: bool = False) -> dict[str, Any]:
        eps = [
            endpoint(b1.ipv4, "n1", ready=ready, serving=True, terminating=terminating),
            endpoint(b2.ipv4, "n2"),
        ]
        return endpoint_slice("a-1", ns, "a", eps, [tcp, udp])

    def names(response: pb.WatchResponse) -> set[tuple[str, str]]:
        return {(k.name, k.port_name) for k in ports_of(response) if k.namespace == ns}

    def port(response: pb.WatchResponse, name: str, port_name: str = "http") -> pb.ServicePort:
        return ports_of(response)[PortKey(ns, name, port_name, pb.TCP, 4)]

    def endpoints(response: pb.WatchResponse, name: str) -> list[tuple[str, bool, bool]]:
        return [(e.ip, e.ready, e.terminating) for e in port(response, name).cluster_endpoints]

    def settled(expected: Callable[[pb.WatchResponse], bool]) -> list[str]:
        """Empty once the agent's state is as `expected` and the copy equals it."""
        copy, fresh = read_dump(dump), fresh_full(socket_path)
        try:
            ready = expected(fresh)
        except KeyError:  # a port not there yet
            ready = False
        if not ready:
            return [f"the agent holds {sorted(names(fresh))} at revision {fresh.revision}"]
        if copy is None:
            return ["no dump yet"]
        return differences(copy, fresh)

    def settle(what: str, expected: Callable[[pb.WatchResponse], bool]) -> None:
        def why() -> str:
            return f"{what}: {settled(expected)}\n{log.read_text()[-3000:]}"

        wait_until(lambda: not settled(expected), 20, interval=0.1, message=why)

    created = {("a", "http"), ("a", "dns"), ("b", "web"), ("c", "http")}
    final = {("a", "http"), ("a", "dns"), ("a", "metrics"), ("c", "http"), ("d", "http")}
    try:
        wait_until(dump.exists, 15, message=lambda: log.read_text())
        # Create: two Services with slices, a NodePort, one with two slices.
        env.kube.apply(
            service("a", ns, a_ports),
            a_slice(ready=True),
            service("b", ns, [service_port("web", 80, 8080)], type="NodePort"),
            endpoint_slice("b-1", ns, "b", env.backend_endpoints(4), [("web", 8080, "TCP")]),
            service("c", ns, [service_port("http", 80, 8080)]),
            endpoint_slice("c-1", ns, "c", env.backend_endpoints(4, ("b1",)), [tcp]),
            endpoint_slice("c-2", ns, "c", env.backend_endpoints(4, ("b2",)), [tcp]),
        )
        settle("after the creations", lambda r: names(r) == created and len(endpoints(r, "c")) == 2)
        # Update: a port added, a port renumbered, a Service's type changed.
        env.kube.apply(
            service("a", ns, [*a_ports, service_port("metrics", 9090, 9090)]),
            service("c", ns, [service_port("http", 81, 8080)], type="NodePort"),
        )
        settle(
            "after the updates",
            lambda r: (
                ("a", "metrics") in names(r)
                and port(r, "c").port == 81
                and port(r, "c").node_port > 0
            ),
        )
        # Endpoints churn: readiness flapping faster than the agent's minSyncPeriod, then a
        # terminating fallback (b1 terminating, b2 ready: only b2), a slice deleted.
        for i in range(6):
            env.kube.apply(a_slice(ready=i % 2 == 1))
        env.kube.apply(a_slice(ready=False, terminating=True))
        env.kube.delete("endpointslice", "c-1", ns)
        settle(
            "after the endpoints churn",
            lambda r: (
                endpoints(r, "a") == [(b2.ipv4, True, False)]
                and endpoints(r, "c") == [(b2.ipv4, True, False)]
            ),
        )
        # Delete a Service, create another.
        env.kube.delete("service", "b", ns)
        env.kube.apply(
            service("d", ns, [service_port("http", 80, 8080)]),
            endpoint_slice("d-1", ns, "d", env.backend_endpoints(4, ("b1",)), [tcp]),
        )
        settle("after the deletion", lambda r: names(r) == final and len(endpoints(r, "d")) == 1)
        copy = read_dump(dump)
        assert copy is not None
        assert names(copy) == final
        lines = log.read_text().splitlines()
        assert sum("(full:" in line for line in lines) == 1, lines
        assert sum("(delta:" in line for line in lines) >= 4, lines
        # SIGUSR1 prints the same copy on stdout.
        proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: read_dump(stdout) is not None, 5, message=lambda: log.read_text())
        assert read_dump(stdout) == copy
    finally:
        proc.terminate()
        code = proc.wait(timeout=10)
    assert code == 0, log.read_text()
    assert f"stopped at revision {copy.revision}" in log.read_text()


def test_a_malformed_request_gets_invalid_argument(env: AgentEnv, socket_path: Path) -> None:
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        watch = channel.stream_stream(WATCH_METHOD)  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as info:
            next(iter(watch(iter([b"\xff\xff\xff"]), timeout=10)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert env.agent is not None and env.agent.alive()
    wait_until(lambda: "malformed WatchRequest" in env.agent.log(), 5)  # type: ignore[union-attr]
    agent_log = env.agent.log()
    assert "Traceback" not in agent_log
    (line,) = [x for x in agent_log.splitlines() if "malformed WatchRequest" in x]
    assert "INVALID_ARGUMENT" in line


def test_a_socket_in_a_shared_directory_is_refused(env: AgentEnv) -> None:
    shared = env.topology.tmpdir / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    agent = env.start_agent(
        "n2", config=None, wait=False, extra_args=["--state-socket", str(shared / "kpx.sock")]
    )
    assert agent.proc.wait(timeout=30) == 2, agent.log()
    assert f"--state-socket {shared}/kpx.sock: {shared} is a shared directory" in agent.log()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert list(shared.iterdir()) == []


def test_an_existing_socket_directory_keeps_its_mode(env: AgentEnv) -> None:
    """A directory the agent did not create is used as it is, while it runs and after it
    stops: its mode is never changed (0755 here; the agent creates its own 0750)."""
    existing = env.topology.tmpdir / "existing-dir"
    existing.mkdir()
    os.chmod(existing, 0o755)
    agent = env.start_agent(
        "n2", config=None, extra_args=["--state-socket", str(existing / "kpx.sock")]
    )
    assert stat.S_ISSOCK((existing / "kpx.sock").stat().st_mode)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
    assert agent.stop() == 0, agent.log_tail()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755


def test_go_client_takes_a_full_state_over_grpc_default_limit(
    go_client: Path, tmp_path: Path
) -> None:
    """A full state over 4 MiB (one port of 200,000 endpoints: 5.6 MB) reaches the Go client:
    it raises gRPC's default limit on received messages (grpc.MaxCallRecvMsgSize)."""
    import asyncio
    import dataclasses

    from kpx_agent.model.types import (
        IP,
        DataplaneSettings,
        Endpoint,
        NodeInfo,
        NodeLocalState,
        Protocol,
    )
    from kpx_agent.model.types import ServicePort as Port
    from kpx_agent.model.types import ServicePortKey as Key
    from kpx_agent.state_api.address import Listen
    from kpx_agent.state_api.publisher import Publisher
    from kpx_agent.state_api.server import StateServer

    eps = tuple(
        Endpoint(IP.of(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"), 8080) for i in range(200_000)
    )
    key = Key("ns", "big", "http", Protocol.TCP, 4)
    port = dataclasses.replace(Port(key=key, port=80), cluster_endpoints=eps)
    dump = tmp_path / "state.json"

    async def main() -> tuple[int, int]:
        pub = Publisher()
        server = StateServer(pub, Listen(path=tmp_path / "run" / "state.sock"))
        await server.start()
        pub.publish(NodeLocalState(NodeInfo("n1"), {key: port}), DataplaneSettings(), None)
        size = len(pub.answer("", 0, False))
        server.notify()
        proc = await asyncio.create_subprocess_exec(
            str(go_client),
            "-target",
            server.listen.target,
            "-dump",
            str(dump),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            for _ in range(300):
                if (copy := read_dump(dump)) is not None:
                    return size, len(copy.service_ports[0].cluster_endpoints)
                await asyncio.sleep(0.1)
            return size, 0
        finally:
            proc.terminate()
            await proc.wait()
            await server.stop()

    size, count = asyncio.run(main())
    assert size > 4 * 1024 * 1024
    assert count == 200_000
