"""A real node's first process, run inside the node's network namespace and a fresh mount
namespace and a UTS namespace of its own (``nsenter --net=... unshare --mount --uts --propagation
private``):

    python -m kpx_cluster.kubelets.supervisor NODE_SPEC.json

It names the UTS namespace after the node (hostNetwork pods share it: their `hostname` is the
node's name, as on a real machine), makes the node's mounts (see config.node_mounts), starts
containerd, imports the images (``ctr -n k8s.io images import``: never pulled), starts the
kubelet, prints ``ready`` and then waits. On SIGTERM it stops the kubelet and then containerd;
pods and shims are ended by the harness through the node's cgroups. When a daemon exits on its
own, so does the supervisor.

An image already in the node's store (its archive names it, and containerd has that name) is
not imported again: a proxy-vm guest's nodes start from a disk whose stores hold the suite's
images (kubelets.cluster, `guest_images`). With `"importOnly": true` in the spec it imports,
stops containerd and prints `imported` (how that disk is made).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

IMPORT = ("images", "import", "--all-platforms", "--digests", "--snapshotter=overlayfs")


def archive_image_name(archive: str) -> str | None:
    """The image name an OCI archive gives containerd (its index's `io.containerd.image.name`,
    else `org.opencontainers.image.ref.name` when that is a full reference), or None."""
    with contextlib.suppress(OSError, KeyError, ValueError, tarfile.TarError):
        with tarfile.open(archive) as tar:
            member = tar.extractfile("index.json")
            if member is None:
                return None
            index = json.load(member)
        for manifest in index.get("manifests", []):
            annotations = manifest.get("annotations") or {}
            name = annotations.get("io.containerd.image.name")
            ref = annotations.get("org.opencontainers.image.ref.name", "")
            if name:
                return str(name)
            if "/" in ref and ":" in ref:
                return str(ref)
    return None


class Supervisor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.log_dir = Path(spec["logDir"])
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def _mount(self) -> None:
        for m in self.spec["mounts"]:
            if m["fstype"]:
                argv = ["mount", "-t", m["fstype"], m["source"], m["target"]]
            else:
                argv = ["mount", "--bind", m["source"], m["target"]]
            subprocess.run(argv, check=True, capture_output=True)

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.procs[name] = proc
        return proc

    def _ctr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = ["ctr", f"--address={self.spec['containerdSocket']}", "--namespace=k8s.io", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)

    def _containerd_answers(self) -> bool:
        try:
            return self._ctr("version", timeout=10).returncode == 0
        except subprocess.TimeoutExpired:  # still loading its plugins (slow under emulation)
            return False

    def _wait_containerd(self) -> None:
        timeout = float(self.spec["containerdStartSeconds"])
        deadline = time.monotonic() + timeout
        while not self._containerd_answers():
            if self.procs["containerd"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"containerd did not answer within {timeout:.0f}s;"
                    f" see {self.log_dir}/containerd.log"
                )
            time.sleep(0.1)

    def start(self) -> None:
        socket.sethostname(self.spec["node"])
        self._mount()
        self._start("containerd", self.spec["containerd"])
        self._wait_containerd()
        listed = self._ctr("images", "ls", "-q")
        present = set(listed.stdout.split()) if listed.returncode == 0 else set()
        for archive in self.spec["archives"]:
            if archive_image_name(archive) in present:
                continue
            done = self._ctr(*IMPORT, archive, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"ctr import {archive}: {done.stderr.strip()}")
        if self.spec.get("importOnly"):
            return
        self._start("kubelet", self.spec["kubelet"])

    def stop(self) -> None:
        self.stopping = True
        for name in ("kubelet", "containerd"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def wait(self) -> int:
        while not self.stopping:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    print(f"{name} exited {proc.returncode}", file=sys.stderr, flush=True)
                    self.stop()
                    return 1
            time.sleep(0.5)
        return 0


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    sup = Supervisor(spec)

    def on_term(signum: int, frame: FrameType | None) -> None:
        sup.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        sup.start()
    except Exception as exc:
        print(f"node {spec['node']}: {exc}", file=sys.stderr, flush=True)
        sup.stop()
        return 1
    if spec.get("importOnly"):
        sup.stop()
        print("imported", flush=True)
        return 0
    print("ready", flush=True)
    return sup.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
