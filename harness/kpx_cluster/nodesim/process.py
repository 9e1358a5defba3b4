"""Container processes of the node simulator: start in a netns, wait (pidfd), stop with grace.

A "container" is one process started by `Topology.run` (``ip netns exec <netns> argv``, which
execs, so the pid is the program's) in its own session, hence its own process group. Exits are
noticed through a pidfd registered with the event loop: no polling, no thread per process. When
the leader exits, the rest of its process group is killed (a container's processes die with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..netns import Target, Topology
from .api import now_rfc3339


@dataclass(frozen=True)
class ExitInfo:
    """How a process ended, in Kubernetes terms."""

    exit_code: int
    signal: int | None
    started_at: str
    finished_at: str
    runtime: float
    """Seconds the process ran."""
    start_error: str = ""
    """Set when the process could not even start (e.g. "StartError")."""

    @property
    def reason(self) -> str:
        if self.start_error:
            return self.start_error
        return "Completed" if self.exit_code == 0 else "Error"


def exit_code_of(returncode: int) -> tuple[int, int | None]:
    """(exitCode as a container runtime reports it, the killing signal or None)."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


def spawn(
    topology: Topology,
    target: Target,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    log_file: Path | None,
) -> subprocess.Popen[Any]:
    """Start `argv` in the netns of `target`, output appended to `log_file` (blocking call)."""
    if log_file is None:
        return topology.run(
            target,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(env),
            cwd=cwd,
        )
    with log_file.open("ab") as log:
        return topology.run(
            target,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
        )


class Process:
    """A started process; create it on the event loop that will wait for it."""

    def __init__(self, popen: subprocess.Popen[Any]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.started_at = now_rfc3339()
        self._started = time.monotonic()
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[ExitInfo] = loop.create_future()
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # already reaped (the topology was cleaned up)
            self._pidfd = None
            self._finish()
            return
        loop.add_reader(self._pidfd, self._on_exit)

    @property
    def running(self) -> bool:
        return not self._done.done()

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._done.result() if self._done.done() else None

    def _on_exit(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._finish()

    def _finish(self) -> None:
        # The leader is a zombie until reaped, so its process group id cannot be reused yet:
        # kill whatever else runs in the group (a container's processes die with it).
        self._killpg(signal.SIGKILL)
        try:
            returncode = self.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:  # pragma: no cover - the pidfd said it exited
            returncode = -signal.SIGKILL
        code, sig = exit_code_of(returncode)
        if not self._done.done():
            self._done.set_result(
                ExitInfo(
                    code, sig, self.started_at, now_rfc3339(), time.monotonic() - self._started
                )
            )

    def _killpg(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def wait(self) -> ExitInfo:
        """Wait for the process to exit."""
        return await asyncio.shield(self._done)

    async def stop(self, grace: float) -> ExitInfo:
        """SIGTERM the process group, SIGKILL it after `grace` seconds; the exit."""
        if self.running:
            self._killpg(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done), timeout=grace)
        if self.running:
            self._killpg(signal.SIGKILL)
        return await self.wait()

    def kill_now(self) -> None:
        """SIGKILL the process group without waiting (for shutdown paths)."""
        if self.running:
            self._killpg(signal.SIGKILL)
