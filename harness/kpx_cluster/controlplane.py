"""A real local Kubernetes control plane: etcd, kube-apiserver, controller-manager, scheduler.

Everything listens on loopback with free ports; etcd's data and all state live under one
directory on tmpfs (/dev/shm) so WAL fsyncs never stall. The same class is the `proxy-cluster`
command and the pytest fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .binaries import etcd_binary, kubernetes_binary
from .kubeconfig import write_kubeconfig
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


class Cluster:
    """One local control plane, identified by its name and state directory."""

    def __init__(self, name: str = "kpx", root: Path = DEFAULT_ROOT) -> None:
        self.name = name
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
    def etcd_url(self) -> str:
        """etcd's client URL (plain HTTP on loopback; tests use its JSON gateway)."""
        return str(self._load_state()["etcdURL"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what the apiserver does every 5 minutes): a watch
        from an older resourceVersion then gets 410 Gone. Returns the revision."""
        revision = int(_etcd_call(self.etcd_url, "kv/range", {"key": "AA=="})["header"]["revision"])
        _etcd_call(self.etcd_url, "kv/compaction", {"revision": revision, "physical": True})
        return revision

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
        api_port, etcd_port, etcd_peer = free_port(), free_port(), free_port()
        kcm_port, sched_port = free_port(), free_port()
        server = f"https://127.0.0.1:{api_port}"
        self._save(
            {
                "server": server,
                "apiserverPort": api_port,
                "etcdURL": f"http://127.0.0.1:{etcd_port}",
                "components": [],
            }
        )

        serving = ca.issue(
            "apiserver",
            "kube-apiserver",
            hosts=(
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
        kcm_kc = self._component_kubeconfig(ca, server, "system:kube-controller-manager")
        sched_kc = self._component_kubeconfig(ca, server, "system:kube-scheduler")

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
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
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
            f"{server}/readyz",
        )
        self._wait(started[-1], timeout)

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
                # No kubelet renews node leases here: the node lifecycle controller would taint
                # every simulated node and evict its pods.
                "--controllers=*,-node-lifecycle-controller",
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

    def client_kubeconfig(self, user: str, groups: tuple[str, ...], path: Path) -> Path:
        """A kubeconfig for a user authenticated by a client certificate (e.g. a node)."""
        ca = CertificateAuthority(self.pki_dir)
        stem = "user-" + "".join(ch if ch.isalnum() else "-" for ch in user)
        pair: KeyPair = ca.issue(stem, user, orgs=groups)
        return write_kubeconfig(path, server=self.server, ca=self.ca_file, user=user, client=pair)

    def _spawn(self, started: list[Component], name: str, argv: list[str], health: str) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.state_dir,
        )
        log.close()
        started.append(Component(name, proc.pid, argv[0], health))
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
        health check; the state file records its new pid."""
        comps = self._components()
        index = next(i for i, c in enumerate(comps) if c.name == name)
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=self.state_dir)  # fmt: skip
        log.close()
        comps[index] = Component(name, proc.pid, argv[0], comps[index].health_url)
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
