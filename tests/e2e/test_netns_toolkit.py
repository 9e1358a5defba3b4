"""The netns toolkit itself: routing between simulated nodes and pods, failure modes the probe
must tell apart (refused vs timeout), host port exposure through the relays, and cleanup."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kpx_cluster import echo_server
from kpx_cluster.netns import IFNAMSIZ, Pod, Target, Topology, leftovers, python_env
from kpx_cluster.probe import ProbeResult, probe

pytestmark = pytest.mark.netns

PORT = 8080


def assert_only(result: ProbeResult, backend: str, source: str, count: int) -> None:
    """Every try answered by `backend`, which saw the client as `source`."""
    assert result.answers == {backend: count}, result
    assert result.sources == {backend: [source]}, result
    assert result.failed == 0, result


def two_nodes(topo: Topology) -> tuple[Pod, Pod]:
    n1, n2 = topo.add_node("n1"), topo.add_node("n2")
    a, b = topo.add_pod(n1, "a"), topo.add_pod(n2, "b")
    echo_server.start(topo, a, "a", PORT)
    echo_server.start(topo, b, "b", PORT)
    return a, b


def test_pods_on_two_nodes_reach_each_other(topology: Topology) -> None:
    a, b = two_nodes(topology)
    for proto in ("tcp", "udp"):
        for dst, src in ((b.ipv4, a.ipv4), (b.ipv6, a.ipv6)):
            result = probe(topology, a, dst, PORT, proto, count=3, timeout=2)
            assert_only(result, "b", src, 3)
    assert_only(probe(topology, b, a.ipv4, PORT, "tcp", count=2, timeout=2), "a", b.ipv4, 2)
    assert_only(probe(topology, b, a.ipv6, PORT, "udp", count=2, timeout=2), "a", b.ipv6, 2)
    # one UDP socket for every try works as well
    result = probe(topology, a, b.ipv4, PORT, "udp", count=3, timeout=2, same_socket=True)
    assert_only(result, "b", a.ipv4, 3)


def test_nodes_reach_own_and_remote_pods(topology: Topology) -> None:
    a, b = two_nodes(topology)
    n1 = a.node
    # its own pod: through cbr0, so the pod sees the cbr0 gateway address
    assert_only(probe(topology, n1, a.ipv4, PORT, "tcp", timeout=2), "a", n1.gateway_v4, 1)
    assert_only(probe(topology, n1, a.ipv6, PORT, "udp", timeout=2), "a", n1.gateway_v6, 1)
    # a remote pod: through the fabric, so the pod sees the node address
    assert_only(probe(topology, n1, b.ipv4, PORT, "udp", timeout=2), "b", n1.ipv4, 1)
    assert_only(probe(topology, n1, b.ipv6, PORT, "tcp", timeout=2), "b", n1.ipv6, 1)


def test_names_addresses_and_routes(topology: Topology) -> None:
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    pod = topology.add_pod(n2, "p")
    assert (n1.ipv4, n2.ipv4, n2.ipv6) == ("10.242.0.1", "10.242.0.2", "fd00:242::2")
    assert (n2.pod_cidr_v4, n2.pod_cidr_v6) == ("10.244.2.0/24", "fd00:244:2::/64")
    assert (pod.ipv4, pod.ipv6) == ("10.244.2.2", "fd00:244:2::2")
    assert all(ns.startswith(topology.prefix) for ns in (n1.netns, pod.netns))
    for target in (n1, n2, pod, topology.fabric_netns):
        links = topology.exec(target, ["ip", "-o", "link", "show"], check=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            assert len(name) <= IFNAMSIZ
            assert name in ("lo", "cbr0", "eth0") or name.startswith(topology.prefix), name
    hairpin = topology.exec(n2, ["ip", "-d", "link", "show", pod.host_if], check=True).stdout
    assert "hairpin on" in hairpin
    routes4 = topology.exec(n1, ["ip", "route"], check=True).stdout
    assert f"10.244.2.0/24 via {n2.ipv4}" in routes4
    assert f"10.96.0.0/16 dev {n1.fabric_if}" in routes4
    routes6 = topology.exec(n1, ["ip", "-6", "route"], check=True).stdout
    assert f"fd00:244:2::/64 via {n2.ipv6}" in routes6
    assert f"fd00:96::/112 dev {n1.fabric_if}" in routes6
    # adding n2 also routed n2 to the pods of the existing n1
    assert f"10.244.1.0/24 via {n1.ipv4}" in topology.exec(n2, ["ip", "route"]).stdout
    sysctl = ["sysctl", "-n", "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"]
    assert topology.exec(n1, sysctl, check=True).stdout.split() == ["1", "1"]
    bnf = ["sysctl", "-n", "net.bridge.bridge-nf-call-iptables"]
    assert topology.exec(n1, bnf, check=True).stdout.strip() == "1"


def _mac(topology: Topology, target: Target, dev: str) -> str:
    out = topology.exec(target, ["ip", "-o", "link", "show", dev], check=True).stdout
    return out.split("link/ether")[1].split()[0]


def test_pod_gateway_mac_survives_pods_coming_and_going(topology: Topology) -> None:
    """A Linux bridge without a MAC of its own takes its lowest port's, so it changed whenever a
    pod came or went; pods kept the old gateway MAC in their neighbor cache (confirmed by their
    working connections), and whatever they sent the gateway to be routed (not DNATed on the
    node, e.g. to another node's NodePort) was flooded to the bridge's ports and lost. cbr0 has a
    fixed MAC, as kubenet's had."""
    a, b = two_nodes(topology)
    n1 = a.node
    gateway_mac = _mac(topology, n1, "cbr0")
    assert_only(probe(topology, a, b.ipv4, PORT, "tcp", timeout=2), "b", a.ipv4, 1)
    # a pod whose port has the lowest possible MAC joins cbr0 ...
    c = topology.add_pod(n1, "c")
    topology.exec(n1, ["ip", "link", "set", c.host_if, "address", "02:00:00:00:00:01"], check=True)
    assert _mac(topology, n1, "cbr0") == gateway_mac
    assert_only(probe(topology, a, b.ipv4, PORT, "tcp", timeout=2), "b", a.ipv4, 1)
    # ... and leaves (as the node simulator removes a pod: its netns deleted)
    subprocess.run(["ip", "netns", "del", c.netns], check=True)
    assert _mac(topology, n1, "cbr0") == gateway_mac
    neigh = topology.exec(a, ["ip", "neigh", "show", n1.gateway_v4], check=True).stdout
    assert gateway_mac in neigh, neigh
    assert_only(probe(topology, a, b.ipv4, PORT, "tcp", count=3, timeout=2), "b", a.ipv4, 3)


def test_closed_port_is_refused_not_timeout(topology: Topology) -> None:
    a, b = two_nodes(topology)
    for dst in (b.ipv4, b.ipv6):
        for proto in ("tcp", "udp"):
            result = probe(topology, a, dst, 9, proto, count=4, timeout=2)
            assert (result.refused, result.timeout, result.answers) == (4, 0, {}), result


DROP_RULES = """
table inet kpxtest_drop {
    chain input {
        type filter hook input priority 0; policy accept;
        tcp dport 9100 drop
        udp dport 9100 drop
    }
}
"""


def test_dropped_traffic_times_out_not_refused(topology: Topology) -> None:
    a, b = two_nodes(topology)
    topology.exec(b, ["nft", "-f", "-"], input=DROP_RULES, check=True)
    for dst in (b.ipv4, b.ipv6):
        for proto in ("tcp", "udp"):
            result = probe(topology, a, dst, 9100, proto, count=2, timeout=0.5)
            assert (result.timeout, result.refused, result.answers) == (2, 0, {}), result
            # the neighbouring port is not dropped: refused, so the timeout came from the rule
            result = probe(topology, a, dst, 9101, proto, count=1, timeout=2)
            assert result.refused == 1, result


# ---- host port exposure --------------------------------------------------------------------


def _answer(conn: socket.socket, framed: bool) -> None:
    """Reply with the sha256 of the request, a newline and the request again.

    The request is everything up to EOF (plain: tests half-close), or, when `framed` (TLS,
    where the client cannot half-close the TCP stream under a live session), an 8-byte length
    and that many bytes.
    """
    with conn:
        if framed:
            data = _recv_exactly(conn, int.from_bytes(_recv_exactly(conn, 8), "big"))
        else:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        conn.sendall(hashlib.sha256(data).hexdigest().encode() + b"\n" + data)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := conn.recv(n - len(data))):
        data += chunk
    return data


@contextmanager
def host_server(tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """A server on the host's 127.0.0.1 (free port) that answers like `_answer`."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stopping = threading.Event()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
                if tls is not None:
                    conn = tls.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):
                if stopping.is_set():
                    return
                continue
            threading.Thread(target=_answer, args=(conn, tls is not None), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stopping.set()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        listener.close()
        thread.join(timeout=5)
        assert not thread.is_alive()


CLIENT = """
import hashlib, socket, ssl, sys
port, cafile = int(sys.argv[1]), sys.argv[2]
data = bytes(range(256)) * 4096
sock = socket.create_connection(("127.0.0.1", port), timeout=20)
expected = hashlib.sha256(data).hexdigest().encode() + b"\\n" + data
buf = b""
if cafile:
    sock = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname="localhost")
    sock.sendall(len(data).to_bytes(8, "big") + data)
    while len(buf) < len(expected) and (chunk := sock.recv(65536)):
        buf += chunk
else:
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    while chunk := sock.recv(65536):
        buf += chunk
print("ok" if buf == expected else "bad")
"""


def _client(topo: Topology, target: Target, port: int, cafile: str = "") -> str:
    """Run CLIENT in `target` against 127.0.0.1:`port`: "ok" when the bytes came back intact."""
    res = topo.exec(target, [sys.executable, "-c", CLIENT, str(port), cafile], timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_expose_host_port_plain(topology: Topology) -> None:
    n1 = topology.add_node("n1")
    with host_server() as port:
        topology.expose_host_port(port, node_port=16443)
        n2 = topology.add_node("n2")  # added after: gets its relay too
        topology.expose_host_port(port, node_port=16443)  # idempotent
        assert _client(topology, n1, 16443) == "ok"
        assert _client(topology, n2, 16443) == "ok"
        # the unix socket lives in a directory only root can enter
        assert stat.S_IMODE(topology.tmpdir.stat().st_mode) == 0o700
        # pods do not get the relay: nothing listens on their loopback
        pod = topology.add_pod(n1, "p")
        closed = probe(topology, pod, "127.0.0.1", 16443, "tcp", timeout=2)
        assert closed.refused == 1, closed


def test_expose_host_port_tls_passes_through(topology: Topology, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ),
            *("-nodes", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"),
            *("-days", "1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    node = topology.add_node("n1")
    with host_server(ctx) as port:
        topology.expose_host_port(port)
        assert _client(topology, node, port, str(cert)) == "ok"


# ---- cleanup ---------------------------------------------------------------------------------


def test_cleanup_after_exception_in_with_block() -> None:
    prefix = ""
    with pytest.raises(RuntimeError, match="boom"), Topology() as topo:
        prefix = topo.prefix
        node = topo.add_node("n1")
        pod = topo.add_pod(node, "a")
        topo.run(pod, ["sleep", "300"])
        topo.expose_host_port(1)  # relays start without anything listening on the host port
        found = leftovers(prefix)
        assert f"netns {pod.netns}" in found
        assert any(f"in netns {pod.netns}" in item for item in found)
        assert any("kpx_cluster.relay unix-to-tcp" in item for item in found)
        assert f"path {topo.tmpdir}" in found
        raise RuntimeError("boom")
    assert prefix
    assert leftovers(prefix) == []


ESCAPE = """
import subprocess, sys
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(child.pid, flush=True)
print("ready", flush=True)
subprocess.run(["sleep", "300"])
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_cleanup_kills_escaped_processes_and_is_idempotent() -> None:
    topo = Topology()
    try:
        pod = topo.add_pod(topo.add_node("n1"), "a")
        in_pod = topo.run_ready(pod, [sys.executable, "-c", ESCAPE])
        on_host = topo.run_ready(None, [sys.executable, "-c", ESCAPE])
        escaped = _session_leaders_marked(topo.prefix)
        assert len(escaped) == 2, escaped  # one sleep per ESCAPE script, each in its own session
    finally:
        topo.cleanup()
    topo.cleanup()
    assert in_pod.poll() is not None and on_host.poll() is not None
    assert not [pid for pid in escaped if _alive(pid)]
    assert leftovers(topo.prefix) == []
    with pytest.raises(RuntimeError):
        topo.add_node("n2")


def _session_leaders_marked(prefix: str) -> list[int]:
    """`sleep 300` processes leading their own session and started under `prefix`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if (entry / "cmdline").read_bytes() != b"sleep\x00300\x00" or os.getsid(pid) != pid:
                continue
            if f"KPX_TOPOLOGY={prefix}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


SIGNALLED = """
import signal, sys, time
# As an interactive Python has it, even when the tests run as a background job (whose
# children start with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
from kpx_cluster.netns import Topology
topo = Topology()
node = topo.add_node("n1")
topo.add_pod(node, "a")
topo.run(node, ["sleep", "300"])
print(topo.prefix, flush=True)
time.sleep(300)
"""


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output in time"
    return proc.stdout.readline().decode().strip()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(signum: int) -> None:
    argv = [sys.executable, "-c", SIGNALLED]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, env=python_env()) as proc:
        try:
            prefix = _read_line(proc, 30)
            assert prefix.startswith("kpx"), prefix
            assert leftovers(prefix)
            proc.send_signal(signum)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.terminate()  # SIGTERM still cleans up; SIGKILL only as a last resort
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert code != 0
    if signum == signal.SIGTERM:
        assert code == -signal.SIGTERM  # the default action still happens after cleanup
    assert leftovers(prefix) == []


def test_an_ignored_sigint_stays_ignored() -> None:
    """A process that ignores SIGINT (a background job's children do) keeps running and keeps
    its topology on SIGINT; SIGTERM still cleans up."""
    script = SIGNALLED.replace("signal.default_int_handler)", "signal.SIG_IGN)")
    argv = [sys.executable, "-c", script]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, env=python_env()) as proc:
        try:
            prefix = _read_line(proc, 30)
            proc.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            assert leftovers(prefix)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
    assert leftovers(prefix) == []
