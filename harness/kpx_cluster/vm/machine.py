"""The host side of `proxy-vm`: boot a guest with qemu, run commands in it, stop it.

The guest boots the cached image (image.py) with software emulation (`-accel tcg`: this
machine's KVM cannot boot a stock kernel), read-only (`-snapshot`: nothing a guest writes to its
root survives it). Host directories are shared over 9p at the same paths. The network is qemu's
user-mode networking: one host loopback port forwards to the guest's command server
(guest.py), and in the guest 10.0.2.2 is the host's loopback, which the command server relays
to the guest's own 127.0.0.1 for the ports a command needs (the apiserver of a KUBECONFIG).

A running guest's state lives in /dev/shm/kpx/vm-<name>/: qemu's pid, the forwarded port, the
token a request must carry (the guest reads it from the shared file) and the console log.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import yaml

from ..binaries import cache_dir, kubernetes_bin_dir
from ..controlplane import DEFAULT_ROOT
from . import image as vm_image

GUEST_PORT = 7000
STDOUT, STDERR, EXIT = 1, 2, 3
BOOT_TIMEOUT = 300.0
# One boot under emulation takes about 18 s here; a rare boot hangs in the early kernel (seen
# once in CI: nothing on the console after the bootloader for 300 s). A boot gets this long,
# then the guest is killed and booted again, up to BOOT_ATTEMPTS times.
BOOT_ATTEMPT_TIMEOUT = 150.0
BOOT_ATTEMPTS = 3
QEMU_BASE = (
    "qemu-system-x86_64",
    "-accel",
    "tcg,thread=multi",
    "-cpu",
    "max",
    "-smp",
    "2",
    "-nographic",
    "-no-reboot",
    "-snapshot",
)


#: The scratch disk's file system label, and where the guest mounts it (guest.py).
SCRATCH_LABEL = "kpxscratch"
SCRATCH_MOUNT = "/var/kpx-scratch"
#: The guest's memory unless `up` is given more (real nodes in the guest need more).
DEFAULT_MEMORY_MB = 1024


class VMError(RuntimeError):
    pass


@dataclass(frozen=True)
class TapLink:
    """A link from the guest to a host-side L2 segment: the open fd of a tap device (opened in
    the network namespace that holds it, see netns.open_tap) and the MAC of the guest's NIC
    on it, by which the guest finds that NIC."""

    fd: int
    mac: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_shares(cwd: Path | None = None) -> list[Path]:
    """The host directories the guest sees at the same paths: the project (first: the init
    stub runs guest.py from it), the working directory, the Kubernetes binaries cache and the
    local control plane's state directory. A directory inside another share is not repeated."""
    candidates = [
        vm_image.PROJECT_ROOT,
        (cwd or Path.cwd()).resolve(),
        cache_dir().resolve(),
        DEFAULT_ROOT,
    ]
    shares: list[Path] = []
    for path in candidates:
        if any(path == s or s in path.parents for s in shares):
            continue
        shares.append(path)
    return shares


def kubeconfig_ports(paths: Iterable[Path]) -> list[int]:
    """Loopback ports of the apiservers the kubeconfigs point at (relayed into the guest)."""
    ports: set[int] = set()
    for path in paths:
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        for cluster in config.get("clusters") or []:
            url = urlparse(str((cluster.get("cluster") or {}).get("server", "")))
            if url.hostname in ("127.0.0.1", "localhost") and url.port:
                ports.add(url.port)
    return sorted(ports)


def _local_kubeconfigs(env: dict[str, str]) -> list[Path]:
    paths = [Path(p) for p in env.get("KUBECONFIG", "").split(":") if p]
    if DEFAULT_ROOT.is_dir():
        paths += sorted(DEFAULT_ROOT.glob("*/admin.kubeconfig"))
    return paths


@dataclass
class Guest:
    name: str = "default"

    @property
    def state_dir(self) -> Path:
        return DEFAULT_ROOT / f"vm-{self.name}"

    @property
    def console_log(self) -> Path:
        return self.state_dir / "console.log"

    def _read(self, what: str) -> str | None:
        try:
            return (self.state_dir / what).read_text().strip()
        except OSError:
            return None

    def pid(self) -> int | None:
        raw = self._read("pid")
        if not raw:
            return None
        try:
            os.kill(int(raw), 0)
        except (ProcessLookupError, ValueError):
            return None
        return int(raw)

    def running(self) -> bool:
        return self.pid() is not None and self.ping()

    # ---- lifecycle -----------------------------------------------------------------------------

    def up(
        self,
        log: Callable[[str], None] = lambda _m: None,
        memory_mb: int = DEFAULT_MEMORY_MB,
        taps: tuple[TapLink, ...] = (),
        scratch_gb: int = 0,
        scratch_from: Path | None = None,
    ) -> None:
        """Boot the guest unless it runs. `taps`: NICs besides the user-mode one (eth0), in
        order, each on a tap device the caller opened; the guest leaves them down.
        `scratch_gb`: a fresh ext4 disk of that size (sparse, in the cache directory, removed
        by `down`), mounted at SCRATCH_MOUNT in the guest: the root image has about 0.5 GB
        free, real nodes' images need more. `scratch_from`: instead, that disk image (an ext4
        file system labelled SCRATCH_LABEL) under qemu's snapshot: the guest's writes go to a
        temporary overlay, the file stays as it was."""
        if self.pid() is not None:
            if self.wait_ready(BOOT_TIMEOUT):
                return
            raise VMError(f"guest {self.name!r} runs but does not answer; see {self.console_log}")
        image = vm_image.build()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        token_file = self.state_dir / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(secrets.token_hex(16))
        port = _free_port()
        (self.state_dir / "port").write_text(str(port))
        shares = default_shares()
        for path in shares:
            path.mkdir(parents=True, exist_ok=True)
        append = [
            "console=ttyS0",
            "root=LABEL=kpxroot",
            "rw",
            "net.ifnames=0",
            "init=/sbin/kpx-init",
            "loglevel=6",
            "panic=-1",
            f"kpx.guest={Path(vm_image.GUEST_PROGRAM).resolve()}",
            f"kpx.token_file={token_file}",
            *(f"kpx.share.{i}=kpx{i}:{path}" for i, path in enumerate(shares)),
        ]
        if scratch_from is None and scratch_gb:
            self._make_scratch(scratch_gb)
        if scratch_from is not None or scratch_gb:
            append.append(f"kpx.scratch={SCRATCH_MOUNT}")
        argv = [
            *QEMU_BASE,
            "-m",
            str(memory_mb),
            "-kernel",
            str(image.kernel),
            "-initrd",
            str(image.initrd),
            "-drive",
            f"file={image.root},format=raw,if=virtio",
            "-append",
            " ".join(append),
            "-netdev",
            f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:{GUEST_PORT}",
            "-device",
            "virtio-net-pci,netdev=n0",
        ]
        if scratch_from is not None:
            argv += ["-drive", f"file={scratch_from},format=raw,if=virtio"]
        elif scratch_gb:
            # Written in place (not under -snapshot): the file is this boot's alone.
            argv += ["-drive", f"file={self.scratch},format=raw,if=virtio,snapshot=off"]
        for i, tap in enumerate(taps, start=1):
            argv += [
                "-netdev",
                f"tap,id=t{i},fd={tap.fd}",
                "-device",
                f"virtio-net-pci,netdev=t{i},mac={tap.mac}",
            ]
        for i, path in enumerate(shares):
            argv += [
                "-virtfs",
                f"local,path={path},mount_tag=kpx{i},security_model=passthrough,"
                f"id=kpx{i},multidevs=remap",
            ]
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            log(f"proxy-vm: booting guest {self.name!r} (software emulation, try {attempt})")
            if self._boot(argv, BOOT_ATTEMPT_TIMEOUT, tuple(t.fd for t in taps)):
                return
            failed_log = self.console_log.with_name(f"console.try{attempt}.log")
            with contextlib.suppress(OSError):
                self.console_log.replace(failed_log)
            log(f"proxy-vm: guest {self.name!r} did not come up; its console: {failed_log}")
        raise VMError(
            f"guest {self.name!r} did not come up in {BOOT_ATTEMPTS} boots; see the consoles "
            f"{self.state_dir}/console.try*.log"
        )

    @property
    def scratch(self) -> Path:
        return cache_dir() / "vm" / f"scratch-{self.name}.img"

    def _make_scratch(self, size_gb: int) -> None:
        self.scratch.unlink(missing_ok=True)
        with open(self.scratch, "wb") as f:
            f.truncate(size_gb << 30)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-L", SCRATCH_LABEL, str(self.scratch)],
            check=True,
            capture_output=True,
        )

    def _boot(self, argv: list[str], timeout: float, pass_fds: tuple[int, ...] = ()) -> bool:
        """Start qemu once; True when the guest answers within `timeout`, else it is stopped."""
        with open(self.console_log, "wb") as console:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        (self.state_dir / "pid").write_text(str(proc.pid))
        if self.wait_ready(timeout, proc):
            return True
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        (self.state_dir / "pid").unlink(missing_ok=True)
        return False

    def wait_ready(self, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            if self.ping():
                return True
            time.sleep(0.5)
        return False

    def down(self, keep_console: bool = False) -> bool:
        """Stop the guest and remove its state (the console logs, of this boot and of the tries
        that hung, stay if `keep_console`)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(VMError, OSError):
                self._request({"op": "poweroff"}, timeout=5)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _reaped(pid):
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _reaped(pid)
        for name in ("pid", "port", "token"):
            (self.state_dir / name).unlink(missing_ok=True)
        self.scratch.unlink(missing_ok=True)
        if not keep_console:
            # this boot's console and those of the tries that hung (see `up`)
            for console in (self.console_log, *self.state_dir.glob("console.try*.log")):
                console.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.state_dir.rmdir()
        return pid is not None

    # ---- requests ------------------------------------------------------------------------------

    def _connect(self, timeout: float) -> socket.socket:
        port = self._read("port")
        if not port:
            raise VMError(f"guest {self.name!r} is not up")
        return socket.create_connection(("127.0.0.1", int(port)), timeout=timeout)

    def _request(
        self,
        request: dict[str, object],
        on_output: Callable[[int, bytes], None] = lambda _c, _d: None,
        timeout: float | None = None,
    ) -> int:
        token = self._read("token") or ""
        with self._connect(timeout or 10) as conn:
            conn.settimeout(timeout)
            conn.sendall(json.dumps({**request, "token": token}).encode() + b"\n")
            reader = conn.makefile("rb")
            while True:
                header = reader.read(5)
                if len(header) < 5:
                    raise VMError("the guest closed the connection before the command's end")
                channel, size = struct.unpack(">BI", header)
                data = reader.read(size)
                if channel == EXIT:
                    return int(data)
                on_output(channel, data)

    def ping(self) -> bool:
        try:
            return self._request({"op": "ping"}, timeout=3) == 0
        except (OSError, VMError, ValueError):
            return False

    def exec(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> int:
        """Run argv in the guest; output goes to on_output (default: this process's stdout and
        stderr); returns its exit code. `env` adds to the guest's environment, whose PATH has
        the Kubernetes binaries and whose PYTHONPATH has the project's sources."""
        env = dict(env or {})
        base = {
            "PATH": f"{kubernetes_bin_dir()}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
            "/sbin:/bin",
            "PYTHONPATH": ":".join(
                str(vm_image.PROJECT_ROOT / d)
                for d in ("api", "kube", "agents", "operator", "harness")
            ),
        }
        env = {**base, **env}
        forward = kubeconfig_ports(_local_kubeconfigs(env))
        return self._request(
            {
                "op": "exec",
                "argv": argv,
                "env": env,
                "cwd": str((cwd or Path.cwd()).resolve()),
                "forward": forward,
            },
            on_output or _to_stdio,
        )


def _reaped(pid: int) -> bool:
    """True once `pid` has ended; reaps it when it is this process's child (qemu started by this
    process would otherwise stay a zombie, which still counts as running)."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _to_stdio(channel: int, data: bytes) -> None:
    stream = sys.stdout.buffer if channel == STDOUT else sys.stderr.buffer
    stream.write(data)
    stream.flush()


#: Environment variables of the host's that a command in the guest gets unless overridden.
PASSED_ENV = ("KUBECONFIG", "PYTHONPATH", "PROXY_CACHE_DIR", "TERM")


def host_env() -> dict[str, str]:
    return {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
