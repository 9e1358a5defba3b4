"""proxy-operator as a host process against the session's cluster, with exactly the RBAC it ships
(operator/manifests) and a token of its own ServiceAccount, as tests/e2e/test_operator.py runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kpx_cluster.controlplane import Cluster, free_port
from kpx_cluster.kubeconfig import write_kubeconfig

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
MANIFESTS = REPO / "operator" / "manifests"
NS = "kpx-system"
#: Everything the operator ships except its Deployment (the operator runs as a host process).
INSTALLED = ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "agent-rbac.yaml")

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float = 30, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last: {value!r})")
        time.sleep(0.2)


def install(cluster: Cluster, workdir: Path) -> Path:
    """The CRD (established) and the operator's namespace and RBAC; returns a kubeconfig with a
    token of the operator's ServiceAccount."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))

    def established() -> bool:
        out = cluster.kubectl("get", "crd", "proxyconfigurations.proxy.kpx.dev", "-o", "json")
        conds = (json.loads(out.stdout).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    wait_until(established, 60, "CRD established")
    cluster.wait_namespace_settled(NS)  # an earlier module may have deleted it
    for name in INSTALLED:
        cluster.kubectl("apply", "--server-side", "-f", str(MANIFESTS / name))
    token = cluster.kubectl("-n", NS, "create", "token", "kpx-operator", "--duration=2h")
    token_file = workdir / "operator.token"
    token_file.write_text(token.stdout.strip())
    return write_kubeconfig(
        workdir / "operator.kubeconfig",
        server=cluster.server,
        ca=cluster.ca_file,
        user="system:serviceaccount:kpx-system:kpx-operator",
        token_file=token_file,
    )


@dataclass
class Operator:
    """One proxy-operator process."""

    proc: subprocess.Popen[bytes]
    health_port: int
    log: Path

    @classmethod
    def start(cls, kubeconfig: Path, log: Path, *flags: str) -> Operator:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / d) for d in ("operator", "api", "kube")]
                + [os.environ.get("PYTHONPATH", "")]
            ),
        }
        env.pop("KUBECONFIG", None)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kpx_operator",
                    "--namespace",
                    NS,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--health-address",
                    f"127.0.0.1:{port}",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        op = cls(proc, port, log)
        wait_until(op.is_leader, 30, f"operator leads (log: {log})")
        return op

    def health(self) -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return dict(json.loads(resp.read()))
        except OSError:
            return None

    def is_leader(self) -> bool:
        return bool((self.health() or {}).get("leader"))

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
