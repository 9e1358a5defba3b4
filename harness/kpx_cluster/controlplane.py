"""A real local Kubernetes control plane: etcd, kube-apiserver, controller-manager, scheduler.

Everything listens on loopback with free ports; etcd's data and all state live under one
directory on tmpfs (/dev/shm) so WAL fsyncs never stall. The same class is the `proxy-cluster`
command and the pytest fixture.

With `netns` (the real-kubelet cluster, docs/real-kubelets.md), every component runs in that
network namespace instead, the apiserver on 0.0.0.0:6443 advertising `advertise` (the address
kubelets and pods dial), and a pair of relays (a unix socket between them) makes it reachable
on the host's loopback for kubectl and the tests: no host process dials a node or pod address.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .binaries import etcd_binary, kubernetes_binary
from .kubeconfig import write_kubeconfig
from .netns import call_in_netns, enter_netns, python_env
from .pki import CertificateAuthority, KeyPair, service_account_keys

DEFAULT_ROOT = Path("/dev/shm/kpx")
SERVICE_CIDRS = ("10.96.0.0/16", "fd00:96::/112")
KUBERNETES_SERVICE_IP = "10.96.0.1"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; the message carries its stderr."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}: {self.stderr.strip()}"


class AlreadyRunning(RuntimeError):
    """`up` was asked for a cluster whose processes are still running."""


class StartupFailed(RuntimeError):
    """A component did not become healthy; the message points at its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _etcd_call(url: str, method: str, body: dict[str, object]) -> dict[str, Any]:
    # Our own etcd on loopback (an http:// URL this module built), never a URL from outside.
    endpoint = f"{url}/v3/{method}"
    request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), method="POST")  # noqa: S310
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        return dict(json.loads(response.read()))


def _pid_alive(pid: int, binary: str) -> bool:
    """True when `pid` is a live (not zombie) process running `binary` (not a recycled pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return False
    return not cmdline or binary.encode() == cmdline.split(b"\0", 1)[0]


@dataclass
class Component:
    name: str
    pid: int
    binary: str
    health_url: str
    netns: str | None = None  # where health_url is dialled (None: the host)
    runs_in: str | None = None  # the netns it runs in (None: the host)


class Cluster:
    """One local control plane, identified by its name and state directory."""

    def __init__(
        self,
        name: str = "kpx",
        root: Path = DEFAULT_ROOT,
        *,
        netns: str | None = None,
        advertise: str | None = None,
    ) -> None:
        if (netns is None) != (advertise is None):
            raise ValueError("netns and advertise go together")
        self.name = name
        self.netns = netns
        self.advertise = advertise
        self.state_dir = root / name
        self.pki_dir = self.state_dir / "pki"
        self.log_dir = self.state_dir / "logs"
        self.kubeconfig = self.state_dir / "admin.kubeconfig"
        self._state_file = self.state_dir / "state.json"

    # -- state -----------------------------------------------------------------------------
    def _load_state(self) -> dict[str, object]:
        try:
            return dict(json.loads(self._state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _components(self) -> list[Component]:
        raw = self._load_state().get("components", [])
        assert isinstance(raw, list)
        return [Component(**c) for c in raw]

    @property
    def server(self) -> str:
        return str(self._load_state()["server"])

    @property
    def cluster_server(self) -> str:
        """The apiserver's URL for kubelets and pods (its advertised address); the host URL
        `server` without a netns."""
        state = self._load_state()
        return str(state.get("clusterServer", state["server"]))

    @property
    def etcd_url(self) -> str:
        """etcd's client URL (plain HTTP on loopback; tests use its JSON gateway)."""
        return str(self._load_state()["etcdURL"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what the apiserver does every 5 minutes): a watch
        from an older resourceVersion then gets 410 Gone. Returns the revision. Dialled from the
        cluster's netns when it has one (etcd listens on that netns's loopback)."""

        def compact() -> int:
            url = self.etcd_url
            revision = int(_etcd_call(url, "kv/range", {"key": "AA=="})["header"]["revision"])
            _etcd_call(url, "kv/compaction", {"revision": revision, "physical": True})
            return revision

        return call_in_netns(self.netns, compact) if self.netns else compact()

    @property
    def apiserver_port(self) -> int:
        return int(str(self._load_state()["apiserverPort"]))

    @property
    def ca_file(self) -> Path:
        return self.pki_dir / "ca.crt"

    def status(self) -> dict[str, bool]:
        """Each component's name -> whether its process runs and answers its health check."""
        return {
            c.name: _pid_alive(c.pid, c.binary) and self._healthy(c) for c in self._components()
        }

    def is_running(self) -> bool:
        comps = self._components()
        return bool(comps) and any(_pid_alive(c.pid, c.binary) for c in comps)

    # -- lifecycle ---------------------------------------------------------------------------
    def up(self, timeout: float = 120.0) -> None:
        """Start etcd, the apiserver, the controller-manager and the scheduler; wait for health."""
        if self.is_running():
            raise AlreadyRunning(
                f"cluster {self.name!r} already runs (state in {self.state_dir}); "
                "`proxy-cluster down` stops it"
            )
        if self.state_dir.exists():
            self._remove_state()
        self.log_dir.mkdir(parents=True)
        started: list[Component] = []
        try:
            self._start_all(started, timeout)
        except BaseException:
            self._stop(started)
            raise

    def _start_all(self, started: list[Component], timeout: float) -> None:
        ca = CertificateAuthority(self.pki_dir)
        sa = service_account_keys(self.pki_dir)
        in_netns = self.netns is not None
        host_port = free_port()
        if in_netns:  # the netns is ours alone: the well-known ports
            api_port, etcd_port, etcd_peer, kcm_port, sched_port = 6443, 2379, 2380, 10257, 10259
        else:
            api_port, etcd_port, etcd_peer = host_port, free_port(), free_port()
            kcm_port, sched_port = free_port(), free_port()
        # `server`: for the host (through the relays with a netns); `local`: for the components.
        server = f"https://127.0.0.1:{host_port}"
        local = f"https://127.0.0.1:{api_port}"
        advertise = self.advertise or "127.0.0.1"
        self._save(
            {
                "server": server,
                "clusterServer": f"https://{advertise}:{api_port}" if in_netns else server,
                "apiserverPort": host_port,
                "etcdURL": f"http://127.0.0.1:{etcd_port}",
                "netns": self.netns,
                "components": [],
            }
        )

        serving = ca.issue(
            "apiserver",
            "kube-apiserver",
            hosts=(
                *((advertise,) if in_netns else ()),
                "127.0.0.1",
                "::1",
                "localhost",
                KUBERNETES_SERVICE_IP,
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            server=True,
        )
        admin = ca.issue("admin", "kubernetes-admin", orgs=("system:masters",))
        write_kubeconfig(
            self.kubeconfig, server=server, ca=ca.pair.cert, user="admin", client=admin
        )
        kcm_kc = self._component_kubeconfig(ca, local, "system:kube-controller-manager")
        sched_kc = self._component_kubeconfig(ca, local, "system:kube-scheduler")
        # Towards real kubelets (logs, exec, port-forward): a client certificate they accept,
        # and their fabric address.
        kubelet_flags: list[str] = []
        if in_netns:
            kubelet_client = ca.issue(
                "apiserver-kubelet-client",
                "kube-apiserver-kubelet-client",
                orgs=("system:masters",),
            )
            kubelet_flags = [
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                "--kubelet-preferred-address-types=InternalIP",
            ]

        etcd_data = self.state_dir / "etcd"
        etcd_url = self.etcd_url
        peer_url = f"http://127.0.0.1:{etcd_peer}"
        self._spawn(
            started,
            "etcd",
            [
                str(etcd_binary()),
                "--name=kpx",
                f"--data-dir={etcd_data}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=kpx={peer_url}",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            f"{etcd_url}/health",
        )
        self._wait(started[-1], timeout)

        self._spawn(
            started,
            "kube-apiserver",
            [
                str(kubernetes_binary("kube-apiserver")),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={'0.0.0.0' if in_netns else '127.0.0.1'}",  # noqa: S104
                f"--advertise-address={advertise}",
                f"--secure-port={api_port}",
                *kubelet_flags,
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.pair.cert}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--anonymous-auth=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                f"--service-cluster-ip-range={','.join(SERVICE_CIDRS)}",
                "--allow-privileged=true",
                "--profiling=false",
                "--event-ttl=1h",
            ],
            f"{local}/readyz",
        )
        self._wait(started[-1], timeout)
        if in_netns:
            self._start_relays(started, api_port, host_port, timeout)

        self._spawn(
            started,
            "kube-controller-manager",
            [
                str(kubernetes_binary("kube-controller-manager")),
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--service-account-private-key-file={sa.key}",
                f"--root-ca-file={ca.pair.cert}",
                f"--cluster-signing-cert-file={ca.pair.cert}",
                f"--cluster-signing-key-file={ca.pair.key}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={','.join(SERVICE_CIDRS)}",
                "--leader-elect=false",
                "--profiling=false",
                # Without real kubelets no one renews node leases: the node lifecycle
                # controller would taint every simulated node and evict its pods.
                "--controllers=*" if in_netns else "--controllers=*,-node-lifecycle-controller",
            ],
            f"https://127.0.0.1:{kcm_port}/healthz",
        )
        self._spawn(
            started,
            "kube-scheduler",
            [
                str(kubernetes_binary("kube-scheduler")),
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--leader-elect=false",
                "--profiling=false",
            ],
            f"https://127.0.0.1:{sched_port}/healthz",
        )
        for comp in started[-2:]:
            self._wait(comp, timeout)

    def _start_relays(
        self, started: list[Component], api_port: int, host_port: int, timeout: float
    ) -> None:
        """apiserver (in the netns) <- unix socket <- the host's 127.0.0.1:`host_port`."""
        sock = self.state_dir / "apiserver.sock"
        relay = [sys.executable, "-m", "kpx_cluster.relay"]
        readyz = f"https://127.0.0.1:{host_port}/readyz"
        self._spawn(
            started,
            "apiserver-relay-netns",
            [*relay, "unix-to-tcp", "--unix", str(sock), "--to", f"127.0.0.1:{api_port}"],
            readyz,
            checked_from_host=True,
        )
        deadline = time.monotonic() + timeout
        while not sock.exists():
            if time.monotonic() > deadline or not _pid_alive(started[-1].pid, sys.executable):
                raise StartupFailed(f"no relay socket {sock}; see {self.log_dir}")
            time.sleep(0.05)
        self._spawn(
            started,
            "apiserver-relay-host",
            [*relay, "tcp-to-unix", "--listen", f"127.0.0.1:{host_port}", "--unix", str(sock)],
            readyz,
            runs_on_host=True,
            checked_from_host=True,
        )
        self._wait(started[-1], timeout)

    def _component_kubeconfig(self, ca: CertificateAuthority, server: str, user: str) -> Path:
        stem = user.split(":")[-1]
        pair = ca.issue(stem, user)
        return write_kubeconfig(
            self.state_dir / f"{stem}.kubeconfig",
            server=server,
            ca=ca.pair.cert,
            user=user,
            client=pair,
        )

    def client_kubeconfig(
        self, user: str, groups: tuple[str, ...], path: Path, *, server: str | None = None
    ) -> Path:
        """A kubeconfig for a user authenticated by a client certificate (e.g. a node), for
        the host's URL of the apiserver unless `server` is given (e.g. `cluster_server`)."""
        ca = CertificateAuthority(self.pki_dir)
        stem = "user-" + "".join(ch if ch.isalnum() else "-" for ch in user)
        pair: KeyPair = ca.issue(stem, user, orgs=groups)
        return write_kubeconfig(
            path, server=server or self.server, ca=self.ca_file, user=user, client=pair
        )

    def _spawn(
        self,
        started: list[Component],
        name: str,
        argv: list[str],
        health: str,
        *,
        runs_on_host: bool = False,
        checked_from_host: bool = False,
    ) -> None:
        """Start a component in the cluster's netns (if any) unless `runs_on_host`; its health
        URL is dialled from there too unless `checked_from_host`."""
        log = (self.log_dir / f"{name}.log").open("ab")
        into = None if runs_on_host else self.netns
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.state_dir,
            env=python_env() if argv[0] == sys.executable else None,
            preexec_fn=(lambda: enter_netns(into)) if into else None,
        )
        log.close()
        check_in = None if checked_from_host else self.netns
        started.append(Component(name, proc.pid, argv[0], health, check_in, into))
        state = self._load_state()
        state["components"] = [c.__dict__ for c in started]
        self._save(state)

    def _save(self, state: dict[str, object]) -> None:
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self._state_file)

    def _ssl_context(self, comp: Component) -> ssl.SSLContext | None:
        if not comp.health_url.startswith("https"):
            return None
        if comp.name == "kube-apiserver":
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
            ctx.load_cert_chain(self.pki_dir / "admin.crt", self.pki_dir / "admin.key")
            return ctx
        # controller-manager and scheduler serve self-signed certs; /healthz is always allowed.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _healthy(self, comp: Component) -> bool:
        if comp.netns is not None:  # dialled from a thread inside the component's netns
            try:
                return call_in_netns(comp.netns, lambda: self._dial_health(comp))
            except OSError:
                return False  # the netns is gone
        return self._dial_health(comp)

    def _dial_health(self, comp: Component) -> bool:
        try:
            with urllib.request.urlopen(  # noqa: S310 - loopback URL built by us
                comp.health_url, timeout=2, context=self._ssl_context(comp)
            ) as resp:
                return int(resp.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def _wait(self, comp: Component, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _pid_alive(comp.pid, comp.binary):
                raise StartupFailed(f"{comp.name} exited; see {self.log_dir / comp.name}.log")
            if self._healthy(comp):
                return
            time.sleep(0.25)
        raise StartupFailed(
            f"{comp.name} not healthy after {timeout:.0f}s; see {self.log_dir / comp.name}.log"
        )

    def down(self) -> list[str]:
        """Stop every process this cluster started and remove its state; returns what stopped."""
        comps = self._components()
        stopped = [c.name for c in comps if _pid_alive(c.pid, c.binary)]
        self._stop(comps)
        self._remove_state()
        return stopped

    @staticmethod
    def _stop(comps: list[Component]) -> None:
        """Stop in reverse start order, each before the next: an apiserver whose etcd is gone
        hangs until killed, so etcd goes last."""
        for comp in reversed(comps):
            if _pid_alive(comp.pid, comp.binary):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(comp.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _pid_alive(comp.pid, comp.binary) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(comp.pid, comp.binary):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(comp.pid, signal.SIGKILL)
            # Reap when the process is our child (the pytest fixture case).
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(comp.pid, os.WNOHANG)

    def stop_component(self, name: str) -> list[str]:
        """Stop one running component (SIGTERM, then SIGKILL after 10 s) and return its argv,
        for `start_component` (the fault-injection suite stops the apiserver for a while)."""
        comp = next(c for c in self._components() if c.name == name)
        argv = [a.decode() for a in Path(f"/proc/{comp.pid}/cmdline").read_bytes().split(b"\0")]
        self._stop([comp])
        return [a for a in argv if a] if argv else []

    def start_component(self, name: str, argv: list[str], timeout: float = 120.0) -> None:
        """Start component `name` again with `argv` (from `stop_component`) and wait for its
        health check, in the netns it ran in; the state file records its new pid."""
        comps = self._components()
        index = next(i for i, c in enumerate(comps) if c.name == name)
        old = comps[index]
        into = old.runs_in
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.state_dir,
            env=python_env() if argv[0] == sys.executable else None,
            preexec_fn=(lambda: enter_netns(into)) if into else None,
        )
        log.close()
        comps[index] = Component(name, proc.pid, argv[0], old.health_url, old.netns, into)
        state = self._load_state()
        state["components"] = [c.__dict__ for c in comps]
        self._save(state)
        self._wait(comps[index], timeout)

    def _remove_state(self) -> None:
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.state_dir)], check=False)

    # -- convenience ---------------------------------------------------------------------------
    def wait_namespace_settled(self, name: str, timeout: float = 180) -> None:
        """Wait until namespace `name` is absent or not terminating: nothing can be created in
        a namespace that an earlier test deleted until it is gone."""
        deadline = time.monotonic() + timeout
        while True:
            # One read: absent, or present and not terminating (two reads race with the
            # namespace's removal between them).
            got = self.kubectl("get", "namespace", name, check=False)
            if got.returncode != 0 or "Terminating" not in got.stdout:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"namespace {name} still terminating after {timeout}s")
            time.sleep(0.5)

    def create_namespace(self, name: str, timeout: float = 30) -> None:
        """Create a namespace (once a deleted one of that name is gone) and wait for its default
        ServiceAccount (Pods need it)."""
        self.wait_namespace_settled(name)
        self.kubectl("create", "namespace", name)
        deadline = time.monotonic() + timeout
        while self.kubectl("-n", name, "get", "sa", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no default ServiceAccount in {name} after {timeout}s")
            time.sleep(0.2)

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster (admin unless `kubeconfig` is given)."""
        argv = [str(kubernetes_binary("kubectl")), f"--kubeconfig={kubeconfig or self.kubeconfig}"]
        result = subprocess.run(
            [*argv, *args], input=input, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, ["kubectl", *args], result.stdout, result.stderr)
        return result
