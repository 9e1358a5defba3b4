"""One container of a simulated pod: its process, restarts, probes and reported status."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import oci
from ..netns import Target, Topology
from .api import Obj, now_rfc3339
from .env import ConfigError, EnvBuilder, expand
from .probe import Prober, ProbeTiming, cancel_all, http_check, tcp_check
from .process import ExitInfo, Process, spawn
from .runc import ImagePullError, RuncContainer, RuncRuntime, container_id
from .status import (
    CONFIG_ERROR,
    CRASH_LOOP_BACKOFF,
    ContainerFacts,
    Exit,
    container_status,
    crash_loop_message,
    image_pull_waiting,
    next_backoff,
    terminated_state,
)

log = logging.getLogger(__name__)

BACKOFF_START, BACKOFF_MAX, STABLE_RUN = 1.0, 10.0, 10.0
CONFIG_RETRY = 2.0
PULL_BACKOFF_START, PULL_BACKOFF_MAX = 2.0, 20.0
PULL_ERROR_SHOWN = 1.0
"""Seconds ErrImagePull shows before the kubelet's next sync reports ImagePullBackOff."""


@dataclass
class ContainerContext:
    """What a container needs from its pod (set up once the pod's sandbox exists)."""

    topology: Topology
    target: Target
    netns: str
    probe_host: str
    log_dir: Path
    cwd: Path
    env: EnvBuilder
    base_env: dict[str, str]
    grace: float
    changed: Callable[[], None]
    note_refusal: Callable[[BaseException], None]
    runc: RuncRuntime | None = None
    """The runc runtime, when the simulator runs images (None: every container a process)."""
    runc_env: EnvBuilder | None = None
    """The environment builder for runc containers (no path rewriting: volumes are mounted)."""
    runc_base_env: dict[str, str] | None = None
    volume_mounts: tuple[oci.Mount, ...] = ()
    pod_security: Obj | None = None
    """The pod's securityContext."""
    pod_name: str = ""
    pod_uid: str = ""
    hostname: str = ""


class Container:
    """Runs one container spec; `run` returns when it should stay terminated."""

    def __init__(self, ctx: ContainerContext, spec: Obj, init: bool = False) -> None:
        self.ctx = ctx
        self.spec = spec
        self.name = str(spec["name"])
        self.init = init
        self.process: Process | None = None
        self.restart_count = 0
        self.ready = False
        self.started = False
        self.last_state: Obj = {}
        self.terminated: Obj | None = None
        self.waiting: tuple[str, str] = ("ContainerCreating", "")
        self.container_id = ""
        self.image_id = ""
        self.env: dict[str, str] = {}
        self._stopping = False
        self._probes: list[asyncio.Task[Any]] = []
        self._spawning: asyncio.Future[subprocess.Popen[Any]] | None = None
        self._runc: RuncContainer | None = None

    @property
    def log_file(self) -> Path:
        return self.ctx.log_dir / f"{self.name}.log"

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, restart_policy: str) -> ExitInfo | None:
        """Start the container and restart it as `restart_policy` says, with back-off."""
        backoff, pull_backoff = BACKOFF_START, PULL_BACKOFF_START
        image = str(self.spec.get("image", ""))
        try:
            while True:
                try:
                    info = await self._run_once()
                except ConfigError as err:
                    self.ctx.note_refusal(err)
                    self._set_waiting(CONFIG_ERROR, str(err))
                    await asyncio.sleep(CONFIG_RETRY)
                    continue
                except ImagePullError as err:
                    log.info("container %s: %s", self.name, err)
                    self._set_waiting(*image_pull_waiting(image, str(err), False))
                    await asyncio.sleep(PULL_ERROR_SHOWN)
                    self._set_waiting(*image_pull_waiting(image, str(err), True))
                    await asyncio.sleep(pull_backoff)
                    pull_backoff = next_backoff(pull_backoff, PULL_BACKOFF_MAX)
                    continue
                if self._stopping:
                    return info
                restart = restart_policy == "Always" or (
                    restart_policy == "OnFailure" and info.exit_code != 0
                )
                if not restart:
                    self.terminated = self._terminated_state(info)
                    self.ctx.changed()
                    return info
                self.last_state = {"terminated": self._terminated_state(info)}
                if info.runtime >= STABLE_RUN:
                    backoff = BACKOFF_START
                self._set_waiting(CRASH_LOOP_BACKOFF, crash_loop_message(backoff, self.name))
                await asyncio.sleep(backoff)
                backoff = next_backoff(backoff, BACKOFF_MAX)
                self.restart_count += 1
        except asyncio.CancelledError:
            await self._abort()
            raise

    async def _run_once(self) -> ExitInfo:
        runc = self.ctx.runc
        if runc is not None and runc.decide(str(self.spec.get("image", ""))) == "runc":
            starter = await self._prepare_runc(runc)
        else:
            prepared = await self._prepare_process()
            if isinstance(prepared, ExitInfo):
                return prepared
            starter = prepared
        self._spawning = asyncio.ensure_future(asyncio.to_thread(starter))
        try:
            popen = await asyncio.shield(self._spawning)  # if cancelled, _abort() reaps it
        except Exception as err:  # e.g. the topology was cleaned up under us
            self._spawning = None
            log.warning("container %s did not start: %s", self.name, err)
            await self._cleanup()
            now = now_rfc3339()
            return ExitInfo(128, None, now, now, 0.0, "StartError")
        self._spawning = None
        self.process = Process(popen)
        self.container_id = (
            f"runc://{self._runc.id}" if self._runc is not None else f"sim://{popen.pid}"
        )
        self.waiting = ("", "")
        self.terminated = None
        log.info("started %s (%s): %s", self.name, self.container_id, popen.args)
        self._start_probes()
        self.ctx.changed()
        info = await self.process.wait()
        await cancel_all(self._probes)
        await self._cleanup()
        self.ready = self.started = False
        self.ctx.changed()
        return info

    async def _prepare_process(self) -> Callable[[], subprocess.Popen[Any]] | ExitInfo:
        """How to start the container as a host process (or the StartError it ends with)."""
        self._runc = None
        self.env = await self.ctx.env.env(self.spec, self.ctx.base_env)
        argv = self.ctx.env.argv(self.spec, self.env)
        if shutil.which(argv[0], path=self.env.get("PATH")) is None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with self.log_file.open("a") as log_out:
                log_out.write(f"nodesim: executable {argv[0]!r} not found\n")
            now = now_rfc3339()
            return ExitInfo(128, None, now, now, 0.0, "StartError")  # retried like a crash
        cwd = self.ctx.env.workdir(self.spec, self.ctx.cwd)
        topology, target, env, log_file = (
            self.ctx.topology,
            self.ctx.target,
            self.env,
            self.log_file,
        )
        return lambda: spawn(topology, target, argv, env, cwd, log_file)

    async def _prepare_runc(self, runc: RuncRuntime) -> Callable[[], subprocess.Popen[Any]]:
        """How to start the container under runc from its image (unpacked here if needed)."""
        image = str(self.spec.get("image", ""))
        unpacked = await asyncio.to_thread(runc.unpack, image)
        self.image_id = f"{image.rsplit(':', 1)[0] if '/' in image else image}@{unpacked.digest}"
        builder = self.ctx.runc_env or self.ctx.env
        self.env = await builder.env(self.spec, self.ctx.runc_base_env or {})
        command = [expand(str(w), self.env) for w in self.spec.get("command") or []]
        args = [expand(str(w), self.env) for w in self.spec.get("args") or []]
        argv = oci.process_args(unpacked.config, command, args)
        sc = oci.SecurityContext.from_pod(
            self.ctx.pod_security or {}, self.spec.get("securityContext") or {}
        )
        try:
            oci.user_of(sc, unpacked.config)
        except oci.SecurityError as err:
            raise ConfigError(str(err)) from err
        if not argv:
            raise ConfigError("no command: the image has no entrypoint or cmd and the pod none")
        cid = container_id(self.ctx.pod_name, self.ctx.pod_uid, self.name, self.restart_count)
        container = self._runc = RuncContainer(runc, cid)
        topology, env, log_file = self.ctx.topology, dict(self.env), self.log_file
        netns_name, mounts, hostname = self.ctx.netns, self.ctx.volume_mounts, self.ctx.hostname
        cwd = self.spec.get("workingDir")

        def start() -> subprocess.Popen[Any]:
            return container.start(
                topology,
                unpacked,
                argv,
                env,
                sc,
                netns_name=netns_name,
                volume_mounts=mounts,
                hostname=hostname,
                cwd=cwd,
                log_file=log_file,
            )

        return start

    async def _cleanup(self) -> None:
        """After the container's process ended: remove what runc keeps of it."""
        if self._runc is not None:
            await asyncio.to_thread(self._runc.cleanup)

    async def _abort(self) -> None:
        """On cancellation: make sure no process of ours survives."""
        await cancel_all(self._probes)
        if self._spawning is not None:
            with contextlib.suppress(Exception):
                popen = await self._spawning
                self.process = Process(popen)
            self._spawning = None
        if self.process is not None and self.process.running:
            await self.process.stop(self.ctx.grace)
        await self._cleanup()

    async def stop(self, task: asyncio.Task[Any] | None, grace: float) -> None:
        """Stop for good: SIGTERM, `grace` seconds, SIGKILL; then end `task` (our `run`)."""
        self._stopping = True
        await cancel_all(self._probes)
        if self.process is not None and self.process.running:
            info = await self.process.stop(grace)
            self.terminated = self._terminated_state(info)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.process is not None and self.terminated is None:
            info_after = self.process.exit_info
            if info_after is not None:
                self.terminated = self._terminated_state(info_after)
        if self.terminated is None and "terminated" in self.last_state:
            self.terminated = self.last_state["terminated"]  # stopped during a back-off
        await self._cleanup()
        self.ready = self.started = False

    def kill_now(self) -> None:
        if self.process is not None:
            self.process.kill_now()
        if self._runc is not None:
            self._runc.kill_now()

    # -- probes ------------------------------------------------------------------------------

    def _start_probes(self) -> None:
        startup = self.spec.get("startupProbe")
        self.started = startup is None
        self.ready = False
        if startup is not None:
            self._add_probe("startup", startup, False, self._on_startup)
        else:
            self._after_started()

    def _after_started(self) -> None:
        readiness, liveness = self.spec.get("readinessProbe"), self.spec.get("livenessProbe")
        if readiness is not None:
            self._add_probe("readiness", readiness, False, self._on_readiness)
        else:
            self.ready = True
        if liveness is not None:
            self._add_probe("liveness", liveness, True, self._on_liveness)

    def _add_probe(
        self, kind: str, spec: Obj, initial: bool, on_change: Callable[[bool], None]
    ) -> None:
        prober = Prober(kind, ProbeTiming.of(spec), self._checker(spec), initial, on_change)
        self._probes.append(asyncio.create_task(prober.run(), name=f"{kind}-{self.name}"))

    def _on_startup(self, ok: bool) -> None:
        if ok:
            self.started = True
            self._after_started()
            self.ctx.changed()
        else:
            self._kill_for_probe("startup")

    def _on_readiness(self, ok: bool) -> None:
        self.ready = ok
        self.ctx.changed()

    def _on_liveness(self, ok: bool) -> None:
        if not ok:
            self._kill_for_probe("liveness")

    def _kill_for_probe(self, kind: str) -> None:
        process = self.process
        if process is not None and process.running:
            log.info("%s probe of %s failed: restarting pid %d", kind, self.name, process.pid)
            task = asyncio.create_task(process.stop(self.ctx.grace))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _port(self, port: object) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(str(port))
        for declared in self.spec.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ValueError(f"container {self.name} has no port named {port!r}")

    def _checker(self, spec: Obj) -> Callable[[], Awaitable[bool]]:
        timeout = float(spec.get("timeoutSeconds", 1))
        netns = self.ctx.netns
        if "httpGet" in spec:
            get = spec["httpGet"]
            host = get.get("host") or self.ctx.probe_host
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            https = str(get.get("scheme", "HTTP")).upper() == "HTTPS"

            async def http() -> bool:
                port = self._port(get["port"])
                path = str(get.get("path") or "/")
                return await http_check(netns, host, port, path, timeout, headers, https)

            return http
        if "tcpSocket" in spec:
            sock = spec["tcpSocket"]
            host = sock.get("host") or self.ctx.probe_host

            async def tcp() -> bool:
                return await tcp_check(netns, host, self._port(sock["port"]), timeout)

            return tcp
        if "exec" in spec:
            command = [str(w) for w in spec["exec"].get("command") or []]

            async def exec_probe() -> bool:
                return await self._exec(command, timeout)

            return exec_probe

        async def unsupported() -> bool:
            return True

        log.warning("probe %s of %s not simulated: always succeeds", sorted(spec), self.name)
        return unsupported

    async def _exec(self, command: list[str], timeout: float) -> bool:
        if not command:
            return False
        if self._runc is not None:
            argv = self._runc.exec_argv(command)
            topology = self.ctx.topology
            popen = await asyncio.to_thread(
                topology.run_host,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            argv = [self.ctx.env.paths.rewrite(w) for w in command]
            popen = await asyncio.to_thread(
                spawn, self.ctx.topology, self.ctx.target, argv, self.env, self.ctx.cwd, None
            )
        proc = Process(popen)
        try:
            async with asyncio.timeout(timeout):
                return (await proc.wait()).exit_code == 0
        except TimeoutError:
            await proc.stop(0)
            return False
        finally:
            if proc.running:
                await proc.stop(0)

    # -- status ------------------------------------------------------------------------------

    def _set_waiting(self, reason: str, message: str) -> None:
        self.waiting = (reason, message)
        self.ctx.changed()

    def _terminated_state(self, info: ExitInfo) -> Obj:
        exit = Exit(
            info.exit_code, info.signal, info.started_at, info.finished_at, info.start_error
        )
        return terminated_state(exit, self.container_id)

    def status(self) -> Obj:
        """This container's entry of status.containerStatuses."""
        running = self.process is not None and self.process.running
        return container_status(
            ContainerFacts(
                name=self.name,
                image=str(self.spec.get("image", "")),
                image_id=self.image_id,
                ready=self.ready,
                started=self.started,
                restart_count=self.restart_count,
                last_state=self.last_state,
                running_since=self.process.started_at if running and self.process else None,
                terminated=self.terminated,
                waiting=self.waiting,
                container_id=self.container_id,
            )
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.running else None
