"""The node-local state API: the conversion covers the whole model, the generated code is fresh,
and the watch contract holds against the real gRPC server on a unix socket."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import stat
import sys
import tracemalloc
from collections.abc import AsyncIterator
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from kpx_agent.model import types as model_types
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    DetectLocal,
    DetectLocalMode,
    Endpoint,
    EndpointConditions,
    LocalPods,
    NodeFacts,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)
from kpx_agent.state_api import convert
from kpx_agent.state_api.address import Listen, parse_address
from kpx_agent.state_api.publisher import Publisher
from kpx_agent.state_api.server import StateServer
from kpx_localstate_client import WATCH_METHOD, PortKey, State
from kpx_localstate_client import localstate_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "api" / "proto"))
import generate  # noqa: E402

# --- conversion -------------------------------------------------------------------------------


def _model_types() -> list[type]:
    """Every dataclass and NamedTuple in model.types: the model's record types."""
    found = []
    for value in vars(model_types).values():
        if not isinstance(value, type) or value.__module__ != model_types.__name__:
            continue
        if dataclasses.is_dataclass(value) or hasattr(value, "_fields"):
            found.append(value)
    return found


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls._fields)  # type: ignore[attr-defined]


# The containers: what they hold is served field by field (NodeLocalState is the response).
CONTAINERS = {model_types.NodeLocalState}


def test_every_model_types_field_is_mapped() -> None:
    """A field added to the model fails here until convert.py maps it (and the .proto has it)."""
    for cls in _model_types():
        if cls in CONTAINERS or cls in convert.NOT_SERVED_TYPES:
            continue
        assert cls in convert.FIELDS, f"model_types.{cls.__name__} is not served by the state API"
        decided = (
            set(convert.FIELDS[cls])
            | set(convert.NOT_SERVED.get(cls, {}))
            | set(convert.SERVED_WITHIN.get(cls, {}))
        )
        assert decided == _field_names(cls), cls.__name__


def test_mapped_proto_fields_exist() -> None:
    """Every field of each proto message (but the response's own) comes from the model."""
    served: dict[str, set[str]] = {}
    for cls, fields in convert.FIELDS.items():
        message = convert.MESSAGES.get(cls, cls.__name__)
        served.setdefault(message, set()).update(fields.values())
    for message, fields in served.items():
        assert set(pb.DESCRIPTOR.message_types_by_name[message].fields_by_name) == fields, message
    not_from_the_model = {"WatchRequest", "WatchResponse", "Networks"}
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(served) | not_from_the_model


def full_port(i: int = 1) -> ServicePort:
    """A port with no field at its default value, so a forgotten field cannot round-trip."""
    ep = Endpoint(IP.of("10.1.0.1"), 8080, True)
    terminating = EndpointConditions(ready=False, serving=True, terminating=True)
    return ServicePort(
        key=ServicePortKey("ns", f"svc{i}", "http", Protocol.UDP, 4),
        port=80 + i,
        cluster_ips=(IP.of("10.96.0.1"),),
        external_ips=(IP.of("192.0.2.1"),),
        load_balancer_ips=(IP.of("198.51.100.1"),),
        node_port=30080,
        cluster_endpoints=(ep,),
        external_endpoints=(ep, Endpoint(IP.of("10.1.0.2"), 8080)),
        external_masquerade=False,
        drop_when_no_cluster_endpoints=True,
        drop_when_no_external_endpoints=True,
        affinity_timeout=10800,
        load_balancer_source_ranges=(ip_network("203.0.113.0/24"),),
        load_balancer_closed=True,
        health_check_node_port=31000,
        short_circuit_endpoints=(Endpoint(IP.of("10.1.0.3"), 8080),),
        endpoint_conditions=((IP.of("10.1.0.2"), terminating),),
    )


def test_round_trip_every_field() -> None:
    port = full_port()
    for f in dataclasses.fields(ServicePort):
        default = f.default if f.default is not dataclasses.MISSING else None
        assert getattr(port, f.name) != default, f"full_port leaves {f.name} at its default"
    assert convert.port_from_proto(convert.port_to_proto(port)) == port
    node = NodeInfo("n1", (IP.of("192.0.2.10"),), "zone-a", (ip_network("10.1.0.0/24"),))
    back = convert.node_from_proto(convert.node_to_proto(node))
    assert back == node and back.zone == "zone-a"
    settings = DataplaneSettings(
        masquerade_bit=3,
        masquerade_all=True,
        cluster_cidrs=(ip_network("10.1.0.0/16"),),
        node_port_networks=(ip_network("192.0.2.0/24"),),
        detect_local=DetectLocal(DetectLocalMode.INTERFACE_NAME_PREFIX, "veth"),
        localhost_node_ports=True,
        conntrack_tcp_be_liberal=True,
    )
    assert convert.settings_from_proto(convert.settings_to_proto(settings)) == settings


def test_endpoint_conditions_are_served_per_endpoint() -> None:
    port = full_port()
    msg = convert.port_to_proto(port)
    conditions = {
        e.ip: (e.ready, e.serving, e.terminating)
        for e in (*msg.cluster_endpoints, *msg.external_endpoints, *msg.short_circuit_endpoints)
    }
    assert conditions == {
        "10.1.0.1": (True, True, False),
        "10.1.0.2": (False, True, True),
        "10.1.0.3": (True, True, False),
    }
    assert port.conditions_of(IP.of("10.1.0.2")).terminating
    assert port.conditions_of(IP.of("10.1.0.1")) == model_types.READY


@pytest.mark.parametrize(
    "facts",
    [
        NodeFacts(
            family=4,
            nodeport_networks=(ip_network("192.0.2.10/32"),),
            local_pods=LocalPods(networks=(ip_network("10.1.0.0/24"),)),
            localhost_node_ports=True,
        ),
        NodeFacts(family=6, nodeport_networks=(), local_pods=LocalPods(interface="cbr0")),
        NodeFacts(family=6, nodeport_networks=None, local_pods=LocalPods(interface_prefix="veth")),
        NodeFacts(family=4),
    ],
    ids=["networks", "no-nodeports", "every-local-address", "defaults"],
)
def test_node_facts_round_trip(facts: NodeFacts) -> None:
    msg = convert.facts_to_proto(facts)
    # None (addresses unknown: every local address) and () (no NodePorts) stay apart.
    assert msg.HasField("node_port_networks") == (facts.nodeport_networks is not None)
    assert convert.facts_from_proto(pb.NodeFacts.FromString(msg.SerializeToString())) == facts


def test_generated_code_is_fresh() -> None:
    assert generate.stale() == [], "run: python3 api/proto/generate.py"


def test_every_proto_message_and_field_is_documented() -> None:
    lines = (REPO / "api/proto/kpx/localstate/v1/localstate.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        declares = text.startswith(("message ", "enum ", "rpc ")) or (
            "=" in text and text.endswith(";") and not text.startswith(("//", "syntax", "option"))
        )
        if declares and "//" not in text:
            assert lines[i - 1].strip().startswith("//"), f"undocumented: {text}"


# --- the publisher's revisions ------------------------------------------------------------------


def state_of(*ports: ServicePort) -> NodeLocalState:
    return NodeLocalState(NodeInfo("n1"), {p.key: p for p in ports})


def test_unchanged_resync_makes_no_revision() -> None:
    pub = Publisher()
    state = state_of(full_port(1), full_port(2))
    assert pub.publish(state, DataplaneSettings(), None) and pub.revision == 1
    assert not pub.publish(state, DataplaneSettings(), None)
    assert not pub.publish(state, DataplaneSettings(), set(state.services))
    assert pub.revision == 1


def test_first_publish_of_an_empty_state_is_a_revision() -> None:
    pub = Publisher()
    assert not pub.ready("", 0)
    assert pub.publish(state_of(), DataplaneSettings(), None)
    assert pub.ready("", 0)


def test_settings_and_zone_changes_make_a_revision() -> None:
    pub = Publisher()
    state = state_of(full_port(1))
    pub.publish(state, DataplaneSettings(), None)
    assert pub.publish(state, DataplaneSettings(masquerade_all=True), set())
    state.node = NodeInfo("n1", zone="z2")
    assert pub.publish(state, DataplaneSettings(masquerade_all=True), set())
    assert pub.revision == 3


def decode(data: bytes) -> pb.WatchResponse:
    return pb.WatchResponse.FromString(data)


def test_full_and_delta_answers() -> None:
    pub = Publisher()
    a, b = full_port(1), full_port(2)
    state = state_of(a, b)
    pub.publish(state, DataplaneSettings(), None)
    full = decode(pub.answer("", 0, True))
    assert full.full and full.revision == 1 and len(full.service_ports) == 2
    assert convert.port_from_proto(full.service_ports[0]) == a
    del state.services[a.key]
    state.services[b.key] = dataclasses.replace(b, port=9999)
    pub.publish(state, DataplaneSettings(), {a.key, b.key})
    delta = decode(pub.answer(pub.instance_id, 1, True))
    assert not delta.full and delta.revision == 2
    assert [p.port for p in delta.service_ports] == [9999]
    assert [convert.key_from_proto(k) for k in delta.deleted] == [a.key]
    assert delta.node.name == "n1"
    # No deltas wanted, another instance, or an older revision: the full state.
    assert decode(pub.answer(pub.instance_id, 1, False)).full
    assert decode(pub.answer("other", 1, True)).full
    pub.publish(state_of(), DataplaneSettings(), None)
    old = decode(pub.answer(pub.instance_id, 1, True))
    assert old.full and old.revision == 3 and not old.service_ports


def test_client_state_applies_deltas_to_the_same_result_as_full() -> None:
    pub = Publisher()
    ports = [full_port(i) for i in range(5)]
    state = state_of(*ports)
    pub.publish(state, DataplaneSettings(), None)
    held = State()
    held.apply(decode(pub.answer("", 0, True)))
    for i in (1, 3):
        state.services.pop(ports[i].key)
    state.services[ports[0].key] = dataclasses.replace(ports[0], node_port=31999)
    pub.publish(state, DataplaneSettings(), {ports[0].key, ports[1].key, ports[3].key})
    held.apply(decode(pub.answer(held.instance_id, held.revision, True)))
    fresh = State()
    fresh.apply(decode(pub.answer("", 0, True)))
    assert held.service_ports == fresh.service_ports and len(held.service_ports) == 3
    assert held.changed == {PortKey("ns", "svc0", "http", pb.UDP, 4)}
    assert len(held.deleted) == 2


# --- the gRPC server (a real unix socket) ------------------------------------------------------


async def _serve(tmp: Path, pub: Publisher) -> StateServer:
    server = StateServer(pub, Listen(path=tmp / "run" / "state.sock"))
    await server.start()
    return server


class Watcher:
    """A raw client: sends a request only when asked to (so a test can stop reading)."""

    def __init__(self, target: str, want_deltas: bool = True) -> None:
        self.channel = aio.insecure_channel(target)
        self.queue: asyncio.Queue[pb.WatchRequest] = asyncio.Queue()
        self.want = want_deltas
        self.state = State()
        method = self.channel.stream_stream(
            WATCH_METHOD,
            request_serializer=pb.WatchRequest.SerializeToString,
            response_deserializer=pb.WatchResponse.FromString,
        )
        self.call = method(self._requests())
        self.pending: asyncio.Future[Any] | None = None

    async def _requests(self) -> AsyncIterator[pb.WatchRequest]:
        while True:
            yield await self.queue.get()

    async def ask(self) -> None:
        await self.queue.put(
            pb.WatchRequest(
                instance_id=self.state.instance_id,
                revision=self.state.revision,
                want_deltas=self.want,
            )
        )
        self.pending = asyncio.ensure_future(self.call.read())

    async def next(self, timeout: float = 5.0) -> pb.WatchResponse:
        """Ask (unless a question is pending) and apply the answer."""
        if self.pending is None:
            await self.ask()
        assert self.pending is not None
        response = await asyncio.wait_for(asyncio.shield(self.pending), timeout)
        self.pending = None
        self.state.apply(response)
        return response

    async def no_answer(self, seconds: float = 0.5) -> None:
        """Ask, and check nothing comes within `seconds` (the question stays pending)."""
        await self.ask()
        assert self.pending is not None
        done, _ = await asyncio.wait({self.pending}, timeout=seconds)
        assert not done, "answered, but nothing newer exists"

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_socket_directory_and_file_modes(tmp_path: Path) -> None:
    async def main() -> None:
        server = await _serve(tmp_path, Publisher())
        path = tmp_path / "run" / "state.sock"
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        assert path.stat().st_uid == os.getuid()
        assert sorted(p.name for p in path.parent.iterdir()) == ["state.sock"]
        await server.stop()
        assert not path.exists()

    run(main())


def _connect_as(path: Path, uid: int | None) -> str:
    """Connect to the socket from a child process running as `uid` (None: as this user)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, try, report one byte
        code = b"?"
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(str(path))
                code = b"c"
            except PermissionError:
                code = b"d"
        finally:
            os.write(write, code)
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return {b"c": "connected", b"d": "denied"}.get(answer, "error")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_an_unprivileged_user_cannot_connect(tmp_path: Path) -> None:
    async def main() -> None:
        os.chmod(tmp_path, 0o755)
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        pub.publish(state_of(), DataplaneSettings(), None)
        server.notify()
        path = tmp_path / "run" / "state.sock"
        as_nobody = await asyncio.to_thread(_connect_as, path, 65534)
        as_owner = await asyncio.to_thread(_connect_as, path, None)
        await server.stop()
        assert as_nobody == "denied"
        assert as_owner == "connected"

    run(main())


def test_no_answer_before_the_first_sync_then_full(tmp_path: Path) -> None:
    async def main() -> None:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        watcher = Watcher(server.listen.target)
        await watcher.no_answer()
        pub.publish(state_of(full_port(1)), DataplaneSettings(), None)
        server.notify()
        response = await watcher.next()
        assert response.full and response.revision == 1 and len(response.service_ports) == 1
        await watcher.close()
        await server.stop()

    run(main())


def test_a_change_makes_exactly_one_revision_and_a_resync_none(tmp_path: Path) -> None:
    async def main() -> None:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        state = state_of(full_port(1))
        pub.publish(state, DataplaneSettings(), None)
        watcher = Watcher(server.listen.target)
        assert (await watcher.next()).revision == 1
        state.services[full_port(2).key] = full_port(2)
        if pub.publish(state, DataplaneSettings(), {full_port(2).key}):
            server.notify()
        delta = await watcher.next()
        assert (delta.revision, delta.full, len(delta.service_ports)) == (2, False, 1)
        # An unchanged resync: no revision, so the next request waits.
        assert not pub.publish(state, DataplaneSettings(), None)
        server.notify()
        await watcher.no_answer()
        await watcher.close()
        await server.stop()

    run(main())


def test_agent_restart_forces_a_full_state(tmp_path: Path) -> None:
    async def main() -> None:
        first = Publisher()
        server = await _serve(tmp_path, first)
        first.publish(state_of(full_port(1)), DataplaneSettings(), None)
        watcher = Watcher(server.listen.target)
        await watcher.next()
        await server.stop()
        await watcher.close()
        # A new agent: same revision number, another instance.
        second = Publisher()
        server = await _serve(tmp_path, second)
        second.publish(state_of(full_port(2)), DataplaneSettings(), None)
        again = Watcher(server.listen.target)
        again.state = watcher.state
        response = await again.next()
        assert response.full and response.instance_id == second.instance_id
        assert set(again.state.service_ports) == {PortKey("ns", "svc2", "http", pb.UDP, 4)}
        await again.close()
        await server.stop()

    run(main())


def test_two_clients_converge_and_an_old_revision_gets_full(tmp_path: Path) -> None:
    async def main() -> None:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        state = state_of()
        pub.publish(state, DataplaneSettings(), None)
        fast, slow = Watcher(server.listen.target), Watcher(server.listen.target)
        await fast.next()
        await slow.next()
        for i in range(5):
            state.services[full_port(i).key] = full_port(i)
            pub.publish(state, DataplaneSettings(), {full_port(i).key})
            server.notify()
            await fast.next()
        response = await slow.next()  # held revision 1, the server is at 6
        assert response.full and response.revision == 6
        assert fast.state.service_ports == slow.state.service_ports
        assert len(fast.state.service_ports) == 5
        await fast.close()
        await slow.close()
        await server.stop()

    run(main())


def test_a_client_that_stops_reading_does_not_grow_the_agent(tmp_path: Path) -> None:
    """Measured: 200 revisions of a 2,000-port state while a client holds an open stream and
    never asks again. The server keeps one state, not one per revision or client."""

    async def main() -> tuple[int, int]:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        ports = {full_port(i).key: full_port(i) for i in range(2000)}
        state = NodeLocalState(NodeInfo("n1"), ports)
        pub.publish(state, DataplaneSettings(), None)
        stalled = Watcher(server.listen.target)
        await stalled.next()
        tracemalloc.start()
        keys = list(ports)

        async def churn(first: int, count: int) -> int:
            for r in range(first, first + count):
                key = keys[r % len(keys)]
                state.services[key] = dataclasses.replace(ports[key], node_port=40000 + r)
                pub.publish(state, DataplaneSettings(), {key})
                server.notify()
                await asyncio.sleep(0)
            return tracemalloc.get_traced_memory()[0]

        after_50 = await churn(0, 50)
        after_250 = await churn(50, 200)
        tracemalloc.stop()
        # The stalled client asks again: the latest revision, as a full state.
        response = await stalled.next()
        assert response.revision == 251 and response.full
        assert len(response.service_ports) == 2000
        await stalled.close()
        await server.stop()
        return after_50, after_250

    after_50, after_250 = run(main())
    # One full answer here is ~200 kB: 200 more revisions may not add even one.
    assert after_250 - after_50 < 100_000, (after_50, after_250)


def test_parse_address() -> None:
    assert parse_address("unix:///run/x/s.sock") == Listen(path=Path("/run/x/s.sock"))
    assert parse_address("/run/x/s.sock") == Listen(path=Path("/run/x/s.sock"))
    assert parse_address("tcp://127.0.0.1:9000") == Listen(host="127.0.0.1", port=9000)
    assert parse_address("tcp://[::1]:9000") == Listen(host="::1", port=9000)
    for bad in ("tcp://0.0.0.0:9000", "tcp://10.0.0.1:1", "unix://rel", "x", "tcp://[::1]:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_tcp_listener_on_loopback(tmp_path: Path) -> None:
    async def main() -> None:
        pub = Publisher()
        server = StateServer(pub, parse_address("tcp://127.0.0.1:0".replace(":0", ":1")))
        server.listen = Listen(host="127.0.0.1", port=0)
        await server.start()
        assert server.listen.port > 0
        pub.publish(state_of(full_port(1)), DataplaneSettings(), None)
        watcher = Watcher(server.listen.target)
        assert (await watcher.next()).full
        await watcher.close()
        await server.stop()

    run(main())


def test_grpc_status_of_an_unreachable_agent(tmp_path: Path) -> None:
    with grpc.insecure_channel(f"unix://{tmp_path}/none.sock") as channel:
        method = channel.stream_stream(WATCH_METHOD)
        with pytest.raises(grpc.RpcError) as info:
            next(iter(method(iter([b""]), timeout=2)))
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --- the agent's wiring --------------------------------------------------------------------------


def test_mode_external_always_serves_the_state_api() -> None:
    from kpx_agent import settings as settings_mod
    from kpx_api.agentconfig import parse_agent_config

    external = parse_agent_config({"mode": "external", "external": {"image": "x/y:1"}})
    assert settings_mod.resolve(external).state_api == "unix:///run/proxy-agent/state.sock"
    nft = parse_agent_config({"mode": "nftables"})
    assert settings_mod.resolve(nft).state_api is None
    on = parse_agent_config(
        {"mode": "nftables", "stateAPI": {"enabled": True, "address": "tcp://127.0.0.1:7000"}}
    )
    assert settings_mod.resolve(on).state_api == "tcp://127.0.0.1:7000"


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:7000", "tcp://10.0.0.1:7000", "unix://x"])
def test_the_api_refuses_non_loopback_tcp(address: str) -> None:
    from kpx_api.agentconfig import parse_agent_config
    from kpx_api.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stateAPI\.address"):
        parse_agent_config({"mode": "nftables", "stateAPI": {"address": address}})


def test_state_socket_flag_enables_the_api() -> None:
    from kpx_agent.cli import _overrides, _run_parser

    args = _run_parser().parse_args(["--mode", "nftables", "--state-socket", "/tmp/s.sock"])
    assert _overrides(args)["stateAPI"] == {"enabled": True, "address": "unix:///tmp/s.sock"}


def test_the_proxier_publishes_after_a_successful_sync_only() -> None:
    """The hook: a Service change makes one revision; a failed kernel sync makes none (the
    next full sync, after the failure, publishes it)."""
    from kpx_agent.backends import state_only
    from kpx_agent.backends.base import BackendError
    from kpx_agent.observability.metrics import AgentMetrics
    from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
    from kpx_agent.sync.proxier import Proxier
    from kpx_api.proxysettings import NamespaceOptOut

    cluster = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        cluster.replace(kind, [])
    backend = state_only.create(DataplaneSettings())
    proxier = Proxier(cluster, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    pub = Publisher()
    proxier.on_synced = lambda local, changed: pub.publish(local, proxier.settings, changed)
    proxier.delete_flows = lambda filters: 0
    assert proxier.sync().ok and pub.revision == 1  # the first (empty) state
    svc = {
        "metadata": {"namespace": "ns", "name": "dns"},
        "spec": {"clusterIPs": ["10.96.0.10"], "ports": [{"port": 53, "protocol": "UDP"}]},
    }
    cluster.upsert(SERVICES, svc)
    failing = True

    def sync(state: NodeLocalState, changed: Any) -> None:
        if failing:
            raise BackendError("no")

    backend.sync = sync  # type: ignore[method-assign]
    assert not proxier.sync().ok and pub.revision == 1
    failing = False
    cluster.touch_all()
    assert proxier.sync().ok and pub.revision == 2
    answer = decode(pub.answer("", 0, True))
    assert [p.key.name for p in answer.service_ports] == ["dns"]
    assert proxier.sync().ok and pub.revision == 2  # nothing changed


def test_a_socket_path_longer_than_a_socket_address(tmp_path: Path) -> None:
    """Served and reached through the directory's descriptor (a deep pod volume path)."""
    from kpx_localstate_client import StateClient

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert len(str(deep / "state.sock")) > 108

    async def main() -> None:
        pub = Publisher()
        server = StateServer(pub, Listen(path=deep / "state.sock"))
        await server.start()
        pub.publish(state_of(full_port(1)), DataplaneSettings(), None)
        assert stat.S_IMODE((deep / "state.sock").stat().st_mode) == 0o600
        client = StateClient(f"unix://{deep}/state.sock")
        states = client.states()
        state = await asyncio.to_thread(next, states)
        assert state.revision == 1 and len(state.service_ports) == 1
        client.close()
        await asyncio.to_thread(states.close)
        await server.stop()

    run(main())


# --- endpoint conditions and node facts, from the cluster objects to the client ---------------

TERMINATING = {"ready": False, "serving": True, "terminating": True}


def _web(*endpoints: tuple[str, dict[str, bool] | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Service and its slice: endpoints as (address, conditions or None)."""
    svc = {
        "metadata": {"namespace": "ns", "name": "web"},
        "spec": {"clusterIPs": ["10.96.0.20"], "ports": [{"port": 80, "protocol": "TCP"}]},
    }
    eps = []
    for address, conditions in endpoints:
        ep: dict[str, Any] = {"addresses": [address], "nodeName": "n2"}
        if conditions is not None:
            ep["conditions"] = conditions
        eps.append(ep)
    slice_ = {
        "metadata": {
            "namespace": "ns",
            "name": "web-1",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }
    return svc, slice_


def test_a_terminating_fallback_endpoint_is_served_as_terminating_serving_not_ready() -> None:
    from kpx_agent.model.service_ports import service_ports

    # Ready endpoints exist: only they are used, and they are plainly ready.
    svc, slice_ = _web(("10.1.0.1", None), ("10.1.0.2", TERMINATING))
    (port,) = service_ports(svc, [slice_], NodeInfo("n1"))
    assert [e.ip for e in port.cluster_endpoints] == ["10.1.0.1"]
    assert port.endpoint_conditions == ()
    # None is ready: the serving-terminating one is the fallback, served with its conditions.
    svc, slice_ = _web(("10.1.0.2", TERMINATING), ("10.1.0.3", {"ready": False}))
    (port,) = service_ports(svc, [slice_], NodeInfo("n1"))
    assert [e.ip for e in port.cluster_endpoints] == ["10.1.0.2"]
    # The unusable 10.1.0.3 (not serving) is neither listed nor described.
    assert port.endpoint_conditions == ((IP.of("10.1.0.2"), EndpointConditions(False, True, True)),)
    response = pb.WatchResponse.FromString(
        pb.WatchResponse(service_ports=[convert.port_to_proto(port)]).SerializeToString()
    )
    (served,) = response.service_ports[0].cluster_endpoints
    assert (served.ip, served.ready, served.serving, served.terminating) == (
        "10.1.0.2",
        False,
        True,
        True,
    )
    assert convert.port_from_proto(response.service_ports[0]) == port


def _proxier_on(backend: Any) -> tuple[Any, Any, Publisher]:
    from kpx_agent.observability.metrics import AgentMetrics
    from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
    from kpx_agent.sync.proxier import Proxier
    from kpx_api.proxysettings import NamespaceOptOut

    cluster = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        cluster.replace(kind, [])
    proxier = Proxier(cluster, backend, "n1", NamespaceOptOut(), AgentMetrics(), backend.settings)
    pub = Publisher()
    proxier.on_synced = lambda local, changed: pub.publish(local, proxier.settings, changed)
    proxier.delete_flows = lambda filters: 0
    return cluster, proxier, pub


def test_conditions_change_no_kernel_rule_but_make_a_revision() -> None:
    """The one endpoint of a Service goes from ready to serving-terminating (the fallback):
    the backends get the same endpoints and program nothing (no nft transaction, no
    iptables-restore); the state API makes one revision with the new conditions."""
    from backend_samples import SETTINGS

    from kpx_agent.backends.iptables.backend import IptablesBackend
    from kpx_agent.backends.iptables.fake import FakeIptables
    from kpx_agent.backends.nftables.backend import NftablesBackend
    from kpx_agent.backends.nftables.fake import FakeNftables
    from kpx_agent.store.cluster_state import SERVICES, SLICES

    nft = FakeNftables()
    ipt = FakeIptables()
    backends = [
        (
            NftablesBackend(SETTINGS, nft),
            lambda: (nft.transactions, nft.dump()),
        ),
        (
            IptablesBackend(
                SETTINGS,
                ipt,
                ensure_sysctl=lambda path, value: None,
            ),
            lambda: (ipt.runs, ipt.dump()),
        ),
    ]
    for backend, kernel in backends:
        cluster, proxier, pub = _proxier_on(backend)
        svc, ready = _web(("10.1.0.2", {"ready": True, "serving": True}))
        cluster.upsert(SERVICES, svc)
        cluster.upsert(SLICES, ready)
        assert proxier.sync().ok
        before = proxier.local.services[next(iter(proxier.local.services))]
        programmed = kernel()
        revision = pub.revision
        cluster.upsert(SLICES, _web(("10.1.0.2", TERMINATING))[1])
        assert proxier.sync().ok
        after = proxier.local.services[before.key]
        assert after.cluster_endpoints == before.cluster_endpoints  # what the backend renders
        assert after.endpoint_conditions != before.endpoint_conditions
        assert kernel() == programmed, backend.mode  # no kernel operation at all
        assert pub.revision == revision + 1
        (served,) = decode(pub.answer("", 0, False)).service_ports[0].cluster_endpoints
        assert (served.ready, served.serving, served.terminating) == (False, True, True)


def test_node_facts_are_served_and_follow_the_node() -> None:
    """The decided NodePort networks, local-pod match and localhost NodePorts reach the client
    as the backends get them; a change of the Node's addresses makes a revision."""
    from kpx_agent.backends import state_only
    from kpx_agent.store.cluster_state import NODES

    settings = DataplaneSettings(
        cluster_cidrs=(ip_network("10.1.0.0/16"),),
        detect_local=DetectLocal(DetectLocalMode.CLUSTER_CIDR),
    )
    backend = state_only.create(settings)
    cluster, proxier, pub = _proxier_on(backend)
    assert proxier.sync().ok
    held = State()
    held.apply(decode(pub.answer("", 0, True)))
    # No Node object yet: NodePorts on every local address (the field absent).
    assert sorted(held.node_facts) == [4, 6]
    assert not held.node_facts[4].HasField("node_port_networks")
    assert list(held.node_facts[4].local_pods.networks) == ["10.1.0.0/16"]
    assert list(held.node_facts[6].local_pods.networks) == []
    node = {
        "metadata": {"name": "n1"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.7"}]},
    }
    cluster.upsert(NODES, node)
    revision = pub.revision
    assert proxier.sync().ok and pub.revision == revision + 1
    held.apply(decode(pub.answer(held.instance_id, held.revision, True)))
    assert list(held.node_facts[4].node_port_networks.cidrs) == ["192.0.2.7/32"]
    # IPv6: the Node has no address of that family, so no NodePorts (present, empty).
    assert held.node_facts[6].HasField("node_port_networks")
    assert list(held.node_facts[6].node_port_networks.cidrs) == []
    for family, facts in proxier.local.facts.items():
        assert convert.facts_from_proto(held.node_facts[family]) == facts


# --- configuration through the operator, and the client distribution ---------------------------


def test_spec_state_api_reaches_the_agent_through_the_operator() -> None:
    """ProxyConfiguration spec.stateAPI -> the operator's agent ConfigMap -> the agent serves
    on that address (in a kernel mode, where it is off unless enabled)."""
    import yaml

    from kpx_agent import settings as settings_mod
    from kpx_api import parse_agent_config, parse_spec
    from kpx_operator import builders
    from kpx_operator.builders import BuildOptions, Owner

    def served(spec: dict[str, Any]) -> str | None:
        cm = builders.config_map(Owner("px", "uid-1"), parse_spec(spec), BuildOptions())
        (text,) = cm["data"].values()
        return settings_mod.resolve(parse_agent_config(yaml.safe_load(text))).state_api

    assert served({"mode": "nftables"}) is None
    on = {"enabled": True, "address": "tcp://127.0.0.1:7001"}
    assert served({"mode": "nftables", "stateAPI": on}) == "tcp://127.0.0.1:7001"
    assert served({"mode": "iptables", "stateAPI": {"enabled": True}}) == (
        "unix:///run/proxy-agent/state.sock"
    )


def test_client_distribution_depends_on_grpcio_and_protobuf_only() -> None:
    import ast
    import tomllib

    from packaging.requirements import Requirement

    folder = REPO / "agents" / "kpx_localstate_client"
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert {Requirement(r).name for r in project["dependencies"]} == {"grpcio", "protobuf"}
    imported = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    assert imported - sys.stdlib_module_names == {"grpc", "google"}


# --- the client's run(): retries, resumes after a restart, stops on SIGTERM ---------------------


def test_run_retries_until_the_agent_is_up_and_resumes_after_a_restart(tmp_path: Path) -> None:
    """run() started before any agent retries with backoff; it hands the handler the first
    full state; after the agent restarts (a new instance, same socket) it takes the new
    instance's full state; close() (what SIGTERM calls) ends it."""
    import threading

    from kpx_localstate_client import StateClient
    from kpx_localstate_client import run as run_client

    path = tmp_path / "run" / "state.sock"
    client = StateClient(f"unix://{path}")
    seen: list[tuple[str, int, frozenset[str]]] = []
    got = threading.Condition()

    def handler(state: State) -> None:
        with got:
            names = frozenset(k.name for k in state.service_ports)
            seen.append((state.instance_id, state.revision, names))
            got.notify_all()

    def wait_for(count: int) -> None:
        with got:
            assert got.wait_for(lambda: len(seen) >= count, timeout=10), seen

    thread = threading.Thread(
        target=run_client,
        args=(handler,),
        kwargs={"client": client, "min_backoff": 0.05, "max_backoff": 0.2},
        daemon=True,
    )
    thread.start()

    async def agent(pub: Publisher, port: ServicePort, then: Any) -> None:
        server = await _serve(tmp_path, pub)
        pub.publish(state_of(port), DataplaneSettings(), None)
        server.notify()
        await asyncio.to_thread(then)
        await server.stop()

    first, second = Publisher(), Publisher()
    asyncio.run(asyncio.sleep(0.3))  # no agent yet: the client is retrying
    assert seen == [] and thread.is_alive()
    run(agent(first, full_port(1), lambda: wait_for(1)))
    run(agent(second, full_port(2), lambda: wait_for(2)))
    client.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen == [
        (first.instance_id, 1, frozenset({"svc1"})),
        (second.instance_id, 1, frozenset({"svc2"})),
    ]


def test_run_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    import signal

    # SIGUSR1 makes the client print every thread's stack: what it waits on when it hangs
    script = (
        "import faulthandler, logging, signal, sys\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "from kpx_localstate_client import run\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "run(lambda s: print('state', s.revision, flush=True), sys.argv[1])\n"
    )

    async def main() -> tuple[int, str]:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        pub.publish(state_of(full_port(1)), DataplaneSettings(), None)
        env = {**os.environ, "PYTHONPATH": str(REPO / "agents")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            server.listen.target,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line == b"state 1\n"
        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1)
            proc.kill()
            await proc.wait()
            code = -1
        err = (await proc.stderr.read()).decode()
        await server.stop()
        return code, err

    code, err = run(main())
    assert code == 0, f"exit code {code} (-1: still running 30 s after SIGTERM); stderr:\n{err}"
    assert "stopped at revision 1" in err


def test_a_full_state_larger_than_grpc_default_message_limit_is_delivered(tmp_path: Path) -> None:
    """gRPC refuses received messages over 4 MB by default (RESOURCE_EXHAUSTED, retried for
    ever): a full state at 10,000 ports x 10 endpoints is about 5 MB."""
    from kpx_localstate_client import StateClient

    eps = tuple(
        Endpoint(IP(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"), 8080) for i in range(200_000)
    )
    big = dataclasses.replace(full_port(1), cluster_endpoints=eps, endpoint_conditions=())

    async def main() -> int:
        pub = Publisher()
        server = await _serve(tmp_path, pub)
        pub.publish(state_of(big), DataplaneSettings(), None)
        size = len(pub.answer("", 0, False))
        assert size > 4 * 1024 * 1024
        client = StateClient(server.listen.target)
        states = client.states()
        state = await asyncio.to_thread(next, states)
        count = len(state.service_ports[PortKey("ns", "svc1", "http", pb.UDP, 4)].cluster_endpoints)
        client.close()
        await asyncio.to_thread(states.close)
        await server.stop()
        return count

    assert run(main()) == 200_000


def test_example_plugins_are_built_only_on_the_client() -> None:
    """Each Python example imports the standard library, kpx_localstate_client and protobuf
    (the client's own dependency) only; every example has a README for plugin authors (the Go
    one, go-localstate, is built on the .proto alone: tests/e2e/test_state_api_go_client.py)."""
    import ast

    plugins = sorted(p for p in (REPO / "examples" / "plugins").iterdir() if p.is_dir())
    assert [p.name for p in plugins] == ["go-localstate", "json-file", "userspace-proxy"]
    assert all((folder / "README.md").is_file() for folder in plugins)
    for folder in (p for p in plugins if any(p.glob("*.py"))):
        assert (folder / "README.md").is_file(), folder.name
        imported = set()
        for path in folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
        assert imported - sys.stdlib_module_names <= {"kpx_localstate_client", "google"}, folder
        assert "kpx_localstate_client" in imported, folder
