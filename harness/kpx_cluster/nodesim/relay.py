"""Optional apiserver access for pods with a netns of their own (not hostNetwork).

hostNetwork pods reach the apiserver at 127.0.0.1:<apiserver port> through the node relays of
`Topology.expose_host_port`. Other pods have their own loopback; with `enabled`, each of them
that mounts a ServiceAccount token gets a relay on its loopback at the same port (one small
Python process per pod), joined to one host-side relay, so the in-cluster address and the
apiserver certificate (valid for 127.0.0.1) work there too. Off by default: it costs a process
per pod.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ..netns import Pod, Topology
from .process import Process

log = logging.getLogger(__name__)


class ApiRelays:
    """Starts loopback relays to the apiserver inside pod network namespaces."""

    def __init__(self, topology: Topology, port: int) -> None:
        self.topology = topology
        self.port = port
        self.enabled = False
        self._socket: Path | None = None
        self._host: Process | None = None
        self._lock: asyncio.Lock | None = None

    async def _host_socket(self) -> Path:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._socket is None:
                sock = self.topology.tmpdir / "nodesim" / f"apiserver-{self.port}.sock"
                argv = self.topology.python_argv("kpx_cluster.relay", "unix-to-tcp")
                argv += ["--unix", str(sock), "--to", f"127.0.0.1:{self.port}"]
                popen = await asyncio.to_thread(self.topology.run_ready, None, argv)
                self._host = Process(popen)
                self._socket = sock
            return self._socket

    async def start_in(self, pod: Pod) -> Process | None:
        """A relay on `pod`'s 127.0.0.1:<port> (None when disabled)."""
        if not self.enabled:
            return None
        sock = await self._host_socket()
        argv = self.topology.python_argv("kpx_cluster.relay", "tcp-to-unix")
        argv += ["--listen", f"127.0.0.1:{self.port}", "--unix", str(sock)]
        popen = await asyncio.to_thread(self.topology.run_ready, pod, argv)
        return Process(popen)

    async def stop(self) -> None:
        if self._host is not None:
            await self._host.stop(1.0)
            self._host = None
            self._socket = None
