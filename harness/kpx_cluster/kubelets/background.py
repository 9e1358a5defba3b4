"""`proxy-cluster up --nodes N`: a RealCluster owned by a background process.

The nodes' namespaces and processes belong to the process that made them (it removes them when
it ends), so `up` starts `python -m kpx_cluster.kubelets.background serve ...` in a session of
its own, waits until it reports the cluster ready (or failed), and returns. `down` sends it
SIGTERM and waits; it then stops every node and the control plane and removes every netns,
cgroup and file. If that process died without cleaning up, `down` sweeps what it left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..controlplane import DEFAULT_ROOT, Cluster
from ..netns import python_env
from .cluster import RealCluster, sweep


@dataclass(frozen=True)
class Files:
    """Where the background process reports (beside the cluster's state dir, which `up`
    recreates)."""

    dir: Path

    @classmethod
    def of(cls, name: str, root: Path) -> Files:
        return cls(root / f"{name}.nodes")

    @property
    def pid(self) -> Path:
        return self.dir / "pid"

    @property
    def ready(self) -> Path:
        return self.dir / "ready.json"

    @property
    def failed(self) -> Path:
        return self.dir / "failed"

    @property
    def log(self) -> Path:
        return self.dir / "serve.log"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X") and b"background" in cmdline


def running_pid(files: Files) -> int | None:
    try:
        pid = int(files.pid.read_text())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


class AlreadyUp(RuntimeError):
    pass


def start(name: str, root: Path, nodes: int, timeout: float = 300) -> dict[str, object]:
    """Start the background owner of `nodes` real nodes; return its ready report."""
    files = Files.of(name, root)
    if running_pid(files) is not None:
        raise AlreadyUp(f"cluster {name!r} already runs; `proxy-cluster down` stops it")
    files.dir.mkdir(parents=True, exist_ok=True)
    for f in (files.ready, files.failed):
        f.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "kpx_cluster.kubelets.background",
        "serve",
        "--name",
        name,
        "--root",
        str(root),
        "--nodes",
        str(nodes),
    ]
    with files.log.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=python_env(),
        )
    files.pid.write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while True:
        if files.ready.exists():
            report: dict[str, object] = json.loads(files.ready.read_text())
            return report
        if files.failed.exists() or proc.poll() is not None:
            proc.wait()
            raise RuntimeError(f"the nodes did not come up; see {files.log}")
        if time.monotonic() > deadline:
            stop(name, root)
            raise RuntimeError(f"the nodes were not up after {timeout:.0f}s; see {files.log}")
        time.sleep(0.2)


def stop(name: str, root: Path, timeout: float = 90) -> list[str]:
    """Stop the background owner and sweep whatever it left; returns what is still left."""
    files = Files.of(name, root)
    pid = running_pid(files)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    left: list[str] = []
    state = Cluster(name, root).state_dir / "real-nodes.json"
    with contextlib.suppress(OSError, ValueError):
        left = sweep(str(json.loads(state.read_text())["prefix"]))
    Cluster(name, root).down()
    subprocess.run(["rm", "-rf", "--one-file-system", str(files.dir)], check=False)
    return left


def serve(name: str, root: Path, nodes: int) -> int:
    files = Files.of(name, root)
    rc = RealCluster(name, nodes=nodes, root=root)
    try:
        started = time.monotonic()
        rc.up()
    except BaseException as exc:
        files.failed.write_text(f"{exc}\n")
        print(f"failed: {exc}", flush=True)
        return 1
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    report = {
        "kubeconfig": str(rc.cluster.kubeconfig),
        "server": rc.cluster.server,
        "nodes": {n: p.ipv4 for n, p in rc.plans.items()},
        "controlPlaneNetns": rc.cluster.netns,
        "nodeNetns": {n: p.netns for n, p in rc.plans.items()},
        "logs": str(rc.cluster.log_dir),
        "seconds": round(time.monotonic() - started, 1),
    }
    files.ready.write_text(json.dumps(report, indent=2))
    print(f"ready in {report['seconds']}s", flush=True)
    while not done.wait(0.5):
        pass
    left = rc.down()
    print(f"down; left: {left}", flush=True)
    return 0 if not left else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kpx_cluster.kubelets.background")
    parser.add_argument("command", choices=("serve",))
    parser.add_argument("--name", default="kpx")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args(argv)
    return serve(args.name, args.root, args.nodes)


if __name__ == "__main__":
    sys.exit(main())
