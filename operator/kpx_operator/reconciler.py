"""One reconcile pass, and the deletion flow, built from the pure parts and the apply edge.

`Reconciler.reconcile` runs on every spec change and on a timer (so a deleted or hand-edited
child comes back): decide (admission), apply or remove the children, observe the DaemonSet,
compute the status and write it when it changed. `Reconciler.finalize` runs when a
ProxyConfiguration is deleted: with spec.deletionPolicy Orphan (the default) the agents keep
running; with Cleanup they stop and their rules go node by node (cleanup.py). Both are
idempotent, so an operator killed half-way simply does the rest on its next pass. Passes for
one object never overlap (a lock per uid).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from kpx_api import (
    MODES_WITH_BACKEND,
    ConfigError,
    ProxyConfigurationSpec,
    ProxyConfigurationStatus,
    no_backend_message,
    parse_spec,
)
from kpx_api.agentconfig import AgentConfiguration, parse_agent_config_text
from kpx_api.preflight import dropped_settings
from kpx_api.proxyconfiguration import DeletionPolicy, ModeSwitchStatus
from kpx_api.scheduling import resolve_int_or_percent
from kpx_api.takeover import KUBE_PROXY_OFF_LABEL, TakeoverStatus

from .admission import (
    Admission,
    IPVSPolicy,
    PxcInfo,
    admit,
    conflict_message,
    node_list,
    orphaned_agents,
)
from .agent_reports import NodeProblem, conntrack_problems
from .apiserver import ApiError, Applied
from .apiserver_endpoints import REFRESH_SECONDS, SLICE_NAME, SLICE_NAMESPACE, endpoints_of
from .builders import (
    CONFIG_KEY,
    BuildOptions,
    ChildRef,
    Owner,
    agent_children,
    child_refs,
    cleanup_daemonset,
)
from .cleanup import (
    CLEANUP_LABEL,
    DELETING_LABEL,
    NodeState,
    Plan,
    marks_patch,
    node_states,
    plan,
    waiting_summary,
)
from .mode_switch import node_phases as switch_phases
from .mode_switch import rollback, rolled_back, stuck, stuck_after, switch_status, track
from .names import AGENT_APP, CLEANUP_APP, LABEL_NAME, child_names, instance, selector_labels
from .preflight import Preflight, assess, preflight_reports
from .preflight import condition as condition_of
from .status import (
    DEFAULT_ROLLOUT_DEADLINE,
    IPVS_DENIED_MESSAGE,
    NFTABLES_ADVICE,
    Observed,
    Rollout,
    compute_status,
    is_current,
    parse_status,
    status_patch,
)
from .takeover import (
    KUBE_PROXY_DAEMONSET,
    KUBE_PROXY_NAMESPACE,
    SERVING,
    Phase,
    affinity_patch,
    node_label_patch,
    node_phases,
    nodes_to_label,
    takeover_status,
)

log = logging.getLogger("kpx_operator")

Obj = dict[str, Any]
#: Posts an event on the ProxyConfiguration: (type Normal|Warning, reason, message).
EventFn = Callable[[str, str, str], None]


class Api(Protocol):
    """What the reconciler needs of the apply edge (`apiserver.ApiServer`)."""

    async def apply(self, obj: Mapping[str, Any]) -> Applied: ...
    async def get(self, kind: str, name: str, namespace: str | None = None) -> Obj | None: ...
    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[Obj]: ...
    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, propagation: str = ...
    ) -> bool: ...
    async def patch_status(self, kind: str, name: str, status: Mapping[str, Any]) -> Obj: ...
    async def patch(
        self, kind: str, name: str, namespace: str | None, body: Mapping[str, Any]
    ) -> Obj: ...


class NotYet(Exception):
    """The deletion waits for something; try again after `delay` seconds."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass(frozen=True)
class OperatorConfig:
    build: BuildOptions = field(default_factory=BuildOptions)
    ipvs_policy: IPVSPolicy = IPVSPolicy.WARN
    #: The modes the agent has a backend for (deploy nothing for the others).
    backends: frozenset[str] = MODES_WITH_BACKEND
    #: Seconds a Cleanup deletion waits without progress (no node turning clean, no step
    #: taken) before it gives up, leaving the rules of the nodes not clean in place.
    cleanup_timeout: float = 300.0
    #: Seconds a rollout may stay Progressing before condition Stalled says
    #: RolloutDeadlineExceeded (None: no deadline).
    rollout_deadline: float | None = DEFAULT_ROLLOUT_DEADLINE


def _ref(kind: str, name: str, namespace: str | None) -> str:
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def _digest(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _selector(pxc_name: str, app: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(pxc_name, app).items())


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class Reconciler:
    def __init__(
        self, api: Api, config: OperatorConfig, clock: Callable[[], datetime] = _now
    ) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._deleting: set[str] = set()
        #: child -> (digest of what we applied, generation or resourceVersion we got back)
        self._seen: dict[tuple[str, str | None, str], tuple[str, str]] = {}
        self._status: dict[str, ProxyConfigurationStatus] = {}  # uid -> last written
        self._told: dict[tuple[str, str], str] = {}  # (uid, topic) -> what we last said
        self._cleared: set[str] = set()  # uids whose children were removed (not deployed)
        #: The apiserver's addresses for the agents, and when they were read (`clock`).
        self._apiserver: tuple[tuple[str, ...], float] | None = None
        #: uid -> (where a Cleanup deletion stood, `runtime` when it last moved)
        self._progress: dict[str, tuple[object, float]] = {}
        #: uid -> (generation, desired nodes, most updated, most ready, when either grew): the
        #: last progress of the agents' rollout, for --rollout-deadline
        self._rollout: dict[str, tuple[int, int, int, int, datetime]] = {}
        #: uids whose agents' DaemonSet this process deleted (a Cleanup under way)
        self._agents_stopped: set[str] = set()

    # -- helpers ---------------------------------------------------------------------------------
    async def _options(self) -> BuildOptions:
        """The build options, with the apiserver's own addresses for the agents unless
        --apiserver-endpoint names one (read at most every REFRESH_SECONDS; on a failed read
        the last known addresses stay, so the agents' pod template does not flap)."""
        opts = self.config.build
        if opts.apiserver_endpoint is not None:
            return opts
        now = self.clock().timestamp()
        if self._apiserver is None or now - self._apiserver[1] >= REFRESH_SECONDS:
            known = self._apiserver[0] if self._apiserver else ()
            try:
                found = endpoints_of(
                    await self.api.get("EndpointSlice", SLICE_NAME, SLICE_NAMESPACE)
                )
            except ApiError as exc:
                keep = ", ".join(known) or "the kubernetes Service"
                log.warning(
                    "the apiserver's addresses (EndpointSlice %s/%s): %s; the agents keep %s",
                    SLICE_NAMESPACE,
                    SLICE_NAME,
                    exc,
                    keep,
                )
                found = known
            if not found and not known:
                log.warning(
                    "the apiserver publishes no address the agents can use: they reach it "
                    "through the kubernetes Service, which needs a proxy on the node (set "
                    "--apiserver-endpoint for clusters without kube-proxy)"
                )
            self._apiserver = (found, now)
        return replace(opts, apiserver_endpoints=self._apiserver[0])

    def _last_progress(self, uid: str, generation: int, ds: Obj | None) -> datetime | None:
        """When the agents' rollout last made progress: a new generation or node count starts
        one; a node more updated or ready is progress (fewer is none: a crashing agent does
        not keep the deadline away)."""
        if ds is None:
            return None
        r = Rollout.from_daemonset(ds)
        mark = self._rollout.get(uid)
        if mark is None or mark[:2] != (generation, r.desired):
            mark = (generation, r.desired, r.updated, r.ready, self.clock())
        elif r.updated > mark[2] or r.ready > mark[3]:
            mark = (
                generation,
                r.desired,
                max(r.updated, mark[2]),
                max(r.ready, mark[3]),
                self.clock(),
            )
        self._rollout[uid] = mark
        return mark[4]

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def _once(self, uid: str, topic: str, key: str) -> bool:
        """True the first time `key` is said about `topic` (then False until it changes)."""
        if self._told.get((uid, topic)) == key:
            return False
        self._told[(uid, topic)] = key
        return True

    def _forget(self, uid: str, pxc_name: str) -> None:
        self._status.pop(uid, None)
        self._rollout.pop(uid, None)
        self._cleared.discard(uid)
        self._locks.pop(uid, None)
        self._told = {k: v for k, v in self._told.items() if k[0] != uid}
        names = child_names(pxc_name)
        self._seen = {
            k: v for k, v in self._seen.items() if k[2] not in (names.agent, names.cleanup)
        }

    def _decide(
        self,
        body: Mapping[str, Any],
        pxcs: Iterable[PxcInfo],
        nodes: Mapping[str, Any],
        orphaned: Mapping[str, tuple[str, ...]] | None = None,
    ) -> tuple[ProxyConfigurationSpec | None, str | None, Admission]:
        me = PxcInfo.from_body(body)
        try:
            spec = parse_spec(body.get("spec") or {})
        except ConfigError as exc:
            return None, str(exc), Admission(deploy=False, deprecated=me.mode == "ipvs")
        return (
            spec,
            None,
            admit(me, pxcs, nodes, self.config.ipvs_policy, self.config.backends, orphaned),
        )

    async def _orphaned(self, name: str, pxcs: Iterable[PxcInfo]) -> dict[str, tuple[str, ...]]:
        """The nodes where agents of deleted configurations (deletionPolicy Orphan) still run,
        by instance ({} when the Pods cannot be read: logged)."""
        ns = self.config.build.namespace
        try:
            pods = await self.api.list("Pod", ns, label_selector=f"{LABEL_NAME}={AGENT_APP}")
        except ApiError as exc:
            log.warning("%s: cannot list the agent Pods: %s", name, exc)
            return {}
        return orphaned_agents(pods, {instance(p.name) for p in pxcs} | {instance(name)})

    def _note(self, obj: Mapping[str, Any], applied: Applied, emit: EventFn) -> None:
        """Events for what an apply changed: created, updated, or a hand edit undone."""
        meta = obj["metadata"]
        kind, name, ns = str(obj["kind"]), str(meta["name"]), meta.get("namespace")
        out = applied.obj.get("metadata") or {}
        marker = str(out.get("generation") if kind == "DaemonSet" else out.get("resourceVersion"))
        digest = _digest(obj)
        key = (kind, ns, name)
        before = self._seen.get(key)
        self._seen[key] = (digest, marker)
        ref = _ref(kind, name, ns)
        if applied.created:
            if before is None:
                emit("Normal", "Created", f"Created {ref}")
            else:
                emit("Normal", "DriftRepaired", f"Re-created {ref}, which had been deleted")
        elif before is not None and before[1] != marker:
            if before[0] != digest:
                how = {
                    "ConfigMap": " (the agents reload it without restarting)",
                    "DaemonSet": " (rolling the agents)",
                }.get(kind, "")
                emit("Normal", "Updated", f"Updated {ref}{how}")
            else:
                emit("Normal", "DriftRepaired", f"Restored {ref}, changed outside the operator")

    async def _delete(self, refs: Iterable[ChildRef], emit: EventFn, why: str) -> None:
        for ref in refs:
            if await self.api.delete(ref.kind, ref.name, ref.namespace):
                what = _ref(ref.kind, ref.name, ref.namespace)
                emit("Normal", "Deleted", f"Deleted {what}: {why}")
            self._seen.pop((ref.kind, ref.namespace, ref.name), None)

    # -- reconcile -------------------------------------------------------------------------------
    async def reconcile(
        self,
        body: Mapping[str, Any],
        pxcs: Iterable[PxcInfo],
        nodes: Mapping[str, Mapping[str, str]],
        emit: EventFn,
    ) -> ProxyConfigurationStatus | None:
        """Apply or remove the children, then write the status; returns the status (None when
        the object is being deleted)."""
        meta = body.get("metadata") or {}
        uid, name = str(meta.get("uid")), str(meta.get("name"))
        async with self._lock(uid):
            if uid in self._deleting or meta.get("deletionTimestamp"):
                return None
            generation = int(meta.get("generation") or 0)
            pxcs = list(pxcs)
            orphaned = await self._orphaned(name, pxcs)
            spec, invalid, admission = self._decide(body, pxcs, nodes, orphaned)
            owner = Owner(name, uid, generation)
            opts = await self._options()
            error: str | None = None
            ds: Obj | None = None
            problems: tuple[NodeProblem, ...] = ()
            takeover: TakeoverStatus | None = None
            preflight: Preflight | None = None
            previous = self._status.get(uid) or parse_status(body.get("status"))
            mode = str((body.get("spec") or {}).get("mode", ""))
            stored: Mapping[str, Any] | None = body.get("status")
            if previous is None:
                # A new object: its status says at once that the operator works on it (kstatus
                # reads an object without status as Current), before any rollout work.
                first = compute_status(
                    Observed(
                        generation,
                        mode,
                        admission,
                        None,
                        invalid=invalid,
                        rollout_deadline=self.config.rollout_deadline,
                    ),
                    None,
                    self.clock(),
                )
                if await self._write_status(name, stored, first):
                    stored, previous = status_patch(first), first
            # Kept as last written when this pass fails before it is followed.
            mode_switch: ModeSwitchStatus | None = previous.mode_switch if previous else None
            try:
                if spec is not None and admission.deploy:
                    self._cleared.discard(uid)
                    current = await self._config_in_effect(name)
                    dropped = dropped_settings(current, spec) if current else []
                    pods = await self._agent_pods(name)
                    states = await self._node_states() if pods is not None else None
                    preflight = assess(
                        str(spec.mode),
                        preflight_reports(pods, states)
                        if pods is not None and states is not None
                        else {},
                        dropped,
                        spec.mode_switch.accept_dropped,
                        str(current.mode) if current else "",
                    )
                    # The switch this pass reports on, known before the apply: while it
                    # runs, the agents' configuration says where to go back to.
                    mode_switch = track(
                        previous.mode_switch if previous else None,
                        str(current.mode) if current else None,
                        str(spec.mode),
                        bool(preflight.held),
                        self.clock(),
                    )
                    if preflight.held:
                        # The switch waits for spec.modeSwitch.acceptDropped: nothing new is
                        # applied, the agents keep the mode in effect.
                        held = ",".join(d.setting.value for d in preflight.held)
                        said = condition_of(preflight)
                        if said and self._once(uid, "held", f"{generation}/{held}"):
                            emit("Warning", "ModeSwitchHeld", said[2])
                        ds = await self.api.get(
                            "DaemonSet", child_names(name).agent, opts.namespace
                        )
                    else:
                        back = rollback(spec, mode_switch, current)
                        children = agent_children(owner, spec, opts, back, admission.kept_out)
                        for obj in children:
                            applied = await self.api.apply(obj)
                            self._note(obj, applied, emit)
                        ds = applied.obj  # the DaemonSet comes last
                    if pods is not None and states is not None:
                        if not spec.conntrack.leaves_node_alone():
                            problems = conntrack_problems(pods, states)
                        if mode_switch is not None:
                            mode_switch = self._follow_switch(
                                uid, generation, mode_switch, spec, pods, states, nodes, emit
                            )
                        if spec.takeover.from_kube_proxy:
                            takeover = await self._take_over(
                                uid, spec, pods, states, nodes, previous, emit
                            )
                else:
                    # Never because of a conflict: that keeps only the contested nodes out.
                    why = (
                        "the spec is invalid"
                        if invalid
                        else "mode ipvs is denied"
                        if admission.ipvs_denied
                        else "its mode has no backend in the agent"
                    )
                    if uid not in self._cleared:  # once, not on every timer tick
                        await self._delete(child_refs(name, opts), emit, why)
                        self._cleared.add(uid)
            except ApiError as exc:
                error = str(exc)
                log.warning("%s: %s", name, error)
                if spec is not None and admission.deploy:
                    try:
                        ds = await self.api.get(
                            "DaemonSet", child_names(name).agent, opts.namespace
                        )
                    except ApiError:
                        ds = None
            self._announce(uid, generation, mode, admission, emit)
            observed = Observed(
                generation,
                mode,
                admission,
                ds,
                error=error,
                invalid=invalid,
                conntrack_problems=problems,
                takeover=takeover,
                preflight=preflight,
                mode_switch=mode_switch,
                rollout_deadline=self.config.rollout_deadline,
                last_progress=self._last_progress(uid, generation, ds),
            )
            status = compute_status(observed, previous, self.clock())
            if await self._write_status(name, stored, status):
                self._status[uid] = status
            return status

    async def _write_status(
        self, name: str, stored: Mapping[str, Any] | None, status: ProxyConfigurationStatus
    ) -> bool:
        """Writes `status` unless `stored` says the same; False when the write failed (logged:
        the next pass tries again)."""
        if not is_current(stored, status):
            try:
                await self.api.patch_status("ProxyConfiguration", name, status_patch(status))
            except ApiError as exc:
                log.warning("%s: cannot write the status: %s", name, exc)
                return False
        return True

    async def _node_states(self) -> list[Obj] | None:
        """The ProxyNodeStates the agents wrote (None when they cannot be read)."""
        try:
            return await self.api.list("ProxyNodeState")
        except ApiError as exc:
            log.warning("cannot read the ProxyNodeStates: %s", exc)
            return None

    def _follow_switch(
        self,
        uid: str,
        generation: int,
        switch: ModeSwitchStatus,
        spec: ProxyConfigurationSpec,
        pods: list[Obj],
        states: list[Obj],
        nodes: Mapping[str, Mapping[str, str]],
        emit: EventFn,
    ) -> ModeSwitchStatus:
        """status.modeSwitch for this pass: each node's phase (from the agent Pods and the
        ProxyNodeStates); a Warning Event ModeSwitchStuck once per set of stuck nodes (and
        generation), ModeSwitchRolledBack once per set of rolled-back nodes, a Normal
        ModeSwitchFinished at the end."""
        if switch.finished_at is not None:
            return switch
        now = self.clock()
        phases = switch_phases(
            pods, states, str(switch.from_mode), str(switch.to_mode), now, stuck_after(spec)
        )
        status = switch_status(switch, phases, nodes.keys(), now)
        back = rolled_back(status)
        key = f"{generation}/" + ",".join(n.name for n in back)
        if back and self._once(uid, "switch-rolled-back", key):
            emit(
                "Warning",
                "ModeSwitchRolledBack",
                f"node {back[0].name} went back to mode {status.from_mode}: {back[0].message}",
            )
        elif not back:
            self._told.pop((uid, "switch-rolled-back"), None)
        blocked = stuck(status)
        key = f"{generation}/" + ",".join(n.name for n in blocked)
        if blocked and self._once(uid, "switch-stuck", key):
            first = blocked[0]
            emit(
                "Warning",
                "ModeSwitchStuck",
                f"the switch to mode {status.to_mode} is stuck on node {first.name}: "
                f"{first.message}. Fix the node, or set spec.mode back to "
                f"{status.from_mode}",
            )
        elif not blocked:
            self._told.pop((uid, "switch-stuck"), None)
        if status.finished_at is not None:
            emit("Normal", "ModeSwitchFinished", status.summary)
        return status

    async def _agent_pods(self, name: str) -> list[Obj] | None:
        """The agent Pods of `name`: only the ProxyNodeStates they wrote count (None when they
        cannot be read)."""
        ns = self.config.build.namespace
        selector = ",".join(f"{k}={v}" for k, v in selector_labels(name, AGENT_APP).items())
        try:
            return await self.api.list("Pod", ns, label_selector=selector)
        except ApiError as exc:
            log.warning("%s: cannot read the agent Pods: %s", name, exc)
            return None

    async def _config_in_effect(self, name: str) -> AgentConfiguration | None:
        """The agents' configuration as the operator last applied it (their ConfigMap), or
        None (none yet, or unreadable)."""
        cm = await self.api.get("ConfigMap", child_names(name).agent, self.config.build.namespace)
        text = ((cm or {}).get("data") or {}).get(CONFIG_KEY)
        if not text:
            return None
        try:
            return parse_agent_config_text(text)
        except ConfigError as exc:
            log.warning("%s: the agents' ConfigMap does not parse: %s", name, exc)
            return None

    async def _take_over(
        self,
        uid: str,
        spec: ProxyConfigurationSpec,
        pods: list[Obj],
        states: list[Obj],
        nodes: Mapping[str, Mapping[str, str]],
        previous: ProxyConfigurationStatus | None,
        emit: EventFn,
    ) -> TakeoverStatus:
        """spec.takeover: each node's phase (an Event on the ProxyConfiguration when it
        changes) and, with moveKubeProxyOff, kube-proxy moved off the nodes kpx serves."""
        phases = node_phases(pods, states)
        before = {
            n.name: n.phase
            for n in (previous.takeover.nodes if previous and previous.takeover else [])
        }
        for node, (phase, message) in sorted(phases.items()):
            if before.get(node) != phase and phase is not Phase.AGENT_NOT_READY:
                kind = "Warning" if phase is Phase.REMOVAL_FAILING else "Normal"
                emit(kind, phase.value, f"node {node}: {message or phase.value}")
        labels = {node: dict(nodes.get(node) or {}) for node in phases}
        if spec.takeover.move_kube_proxy_off:
            for node in await self._move_kube_proxy_off(uid, phases, nodes, emit):
                labels[node][KUBE_PROXY_OFF_LABEL] = "true"
        return takeover_status(phases, labels)

    async def _move_kube_proxy_off(
        self,
        uid: str,
        phases: Mapping[str, tuple[Phase, str]],
        nodes: Mapping[str, Mapping[str, str]],
        emit: EventFn,
    ) -> list[str]:
        """Keep kube-system/kube-proxy off the nodes kpx serves: its affinity excludes
        KUBE_PROXY_OFF_LABEL (patched when it does not), then each such node gets the label.
        Returns the nodes labelled now. Failures are logged and tried again next pass."""
        if not any(phase in SERVING for phase, _ in phases.values()):
            return []
        ref = f"DaemonSet {KUBE_PROXY_NAMESPACE}/{KUBE_PROXY_DAEMONSET}"
        try:
            ds = await self.api.get("DaemonSet", KUBE_PROXY_DAEMONSET, KUBE_PROXY_NAMESPACE)
            if ds is None:
                if self._once(uid, "kube-proxy", "absent"):
                    emit("Normal", "KubeProxyNotFound", f"no {ref}: nothing to move off the nodes")
                return []
            patch = affinity_patch(ds)
            if patch is not None:
                await self.api.patch("DaemonSet", KUBE_PROXY_DAEMONSET, KUBE_PROXY_NAMESPACE, patch)
                emit(
                    "Normal",
                    "KubeProxyAffinityPatched",
                    f"{ref}: its Pods now stay off nodes labelled {KUBE_PROXY_OFF_LABEL} "
                    "(its pod template changed: kube-proxy restarts on the other "
                    "nodes)",
                )
            self._told.pop((uid, "kube-proxy"), None)
            done = []
            for node in nodes_to_label(phases, nodes):
                await self.api.patch("Node", node, None, node_label_patch(node, True))
                done.append(node)
                emit(
                    "Normal",
                    "KubeProxyMovedOff",
                    f"node {node}: kpx serves it; labelled {KUBE_PROXY_OFF_LABEL}=true, so "
                    f"{ref} leaves it",
                )
            return done
        except ApiError as exc:
            log.warning("moving kube-proxy off the nodes: %s", exc)
            if self._once(uid, "kube-proxy", f"error/{exc}"):
                emit(
                    "Warning",
                    "KubeProxyNotMoved",
                    f"cannot move {ref} off the nodes kpx serves (retrying): {exc}",
                )
            return []

    def _announce(
        self, uid: str, generation: int, mode: str, adm: Admission, emit: EventFn
    ) -> None:
        """Warning events, once per spec generation (or per change of the conflict)."""
        if adm.ipvs_denied:
            if self._once(uid, "ipvs", f"denied/{generation}"):
                emit("Warning", "IPVSDenied", IPVS_DENIED_MESSAGE)
        elif adm.no_backend:
            if self._once(uid, "mode", f"no-backend/{generation}"):
                message = f"nothing is deployed: {no_backend_message(mode)}"
                emit("Warning", "ModeNotImplemented", message)
        elif (
            adm.deprecated
            and self.config.ipvs_policy is IPVSPolicy.WARN
            and self._once(uid, "ipvs", f"warned/{generation}")
        ):
            emit("Warning", "DeprecatedMode", NFTABLES_ADVICE)
        conflict = conflict_message(adm) if adm.overlaps else ""
        if self._once(uid, "conflict", conflict) and conflict:
            emit("Warning", "NodeConflict", conflict)

    # -- deletion --------------------------------------------------------------------------------
    async def finalize(
        self,
        body: Mapping[str, Any],
        pxcs: Iterable[PxcInfo],
        nodes: Mapping[str, Mapping[str, str]],
        runtime: float,
        emit: EventFn,
    ) -> None:
        """What spec.deletionPolicy says: Orphan leaves the agents running (their DaemonSet and
        ConfigMap stay); Cleanup stops them and removes their rules node by node. Raises
        NotYet while it waits; a Cleanup that makes no progress for `cleanup_timeout` seconds
        stops waiting, says which nodes keep their rules, and finishes."""
        meta = body.get("metadata") or {}
        uid, name = str(meta.get("uid")), str(meta.get("name"))
        self._deleting.add(uid)
        opts = await self._options()
        async with self._lock(uid):
            spec, _, admission = self._decide(body, pxcs, nodes)
            if spec is None or not admission.deploy:
                # Nothing of ours runs on the nodes: nothing to keep, nothing to clean.
                await self._delete(child_refs(name, opts), emit, "its ProxyConfiguration is gone")
                self._forget(uid, name)
                return
            if spec.deletion_policy is DeletionPolicy.ORPHAN:
                await self._orphan(name, spec, emit)
            else:
                await self._clean_node_by_node(uid, name, spec, admission, nodes, runtime, emit)
            self._forget(uid, name)
            self._progress.pop(uid, None)
            self._agents_stopped.discard(uid)

    async def _orphan(self, name: str, spec: ProxyConfigurationSpec, emit: EventFn) -> None:
        """deletionPolicy Orphan: the agents' DaemonSet and ConfigMap stay (they carry no
        ownerReference, so no garbage collection follows), the agents keep serving; only a
        cleanup DaemonSet of an interrupted Cleanup goes. An Event says how to remove them."""
        opts = self.config.build
        names = child_names(name)
        await self._delete(
            [ChildRef("DaemonSet", names.cleanup, opts.namespace)], emit, "deletionPolicy is Orphan"
        )
        agents = await self.api.get("DaemonSet", names.agent, opts.namespace)
        if agents is None:
            return
        ds = f"DaemonSet {opts.namespace}/{names.agent}"
        message = (
            f"spec.deletionPolicy is Orphan: {ds} and its ConfigMap are left in place, so "
            f"its agents keep serving Services and their {spec.mode} rules stay on the nodes. "
            "To remove them later: re-create this ProxyConfiguration (it adopts them) with "
            "spec.deletionPolicy: Cleanup, then delete it; or delete the DaemonSet and the "
            f"ConfigMap (the agents stop and leave their rules) and run `proxy-agent cleanup "
            f"--mode {spec.mode}` on each node"
        )
        log.info("%s: %s", name, message)
        emit("Normal", "AgentsOrphaned", message)

    async def _clean_node_by_node(
        self,
        uid: str,
        name: str,
        spec: ProxyConfigurationSpec,
        admission: Admission,
        nodes: Mapping[str, Mapping[str, str]],
        runtime: float,
        emit: EventFn,
    ) -> None:
        """deletionPolicy Cleanup (cleanup.py): the agents' DaemonSet goes first with its Pods
        orphaned (they keep serving), then each node in turn, `spec.maxUnavailable` at a time:
        kube-proxy back and Ready (moveKubeProxyOff), its agent stopped, its rules removed by
        the cleanup DaemonSet's Pod there. When there was no DaemonSet to delete and there is
        no agent Pod and no node in its turn (the DaemonSet deleted by hand: its agents left
        their rules), the nodes spec.nodeSelector selects (but the contested ones) are
        cleaned."""
        opts = self.config.build
        ns = opts.namespace
        names = child_names(name)
        inst = instance(name)
        agents = await self.api.get("DaemonSet", names.agent, ns)
        if agents is not None and not (agents.get("metadata") or {}).get("deletionTimestamp"):
            # Orphan propagation: the Pods stay, and are stopped one node at a time below.
            await self.api.delete("DaemonSet", names.agent, ns, propagation="Orphan")
            self._agents_stopped.add(uid)
            emit(
                "Normal",
                "StoppingAgents",
                f"Deleting DaemonSet {ns}/{names.agent} (its Pods stay), then cleaning the "
                f"nodes {spec.max_unavailable} at a time",
            )
        applied = await self.api.apply(cleanup_daemonset(Owner(name, uid), spec, opts))
        if applied.created:
            emit(
                "Normal",
                "CleanupStarted",
                f"Removing the {spec.mode} rules node by node (DaemonSet {ns}/{names.cleanup})",
            )
        agent_pods = await self.api.list("Pod", ns, label_selector=_selector(name, AGENT_APP))
        cleanup_pods = await self.api.list("Pod", ns, label_selector=_selector(name, CLEANUP_APP))
        marked = [
            n
            for label in (DELETING_LABEL, CLEANUP_LABEL)
            for n in await self.api.list("Node", label_selector=f"{label}={inst}")
        ]
        wait_for_kube_proxy, kube_proxy_pods = False, []
        if spec.takeover.move_kube_proxy_off:
            kube_proxy = await self.api.get("DaemonSet", KUBE_PROXY_DAEMONSET, KUBE_PROXY_NAMESPACE)
            if kube_proxy is not None:
                wait_for_kube_proxy = True
                match = ((kube_proxy.get("spec") or {}).get("selector") or {}).get(
                    "matchLabels"
                ) or {}
                kube_proxy_pods = await self.api.list(
                    "Pod",
                    KUBE_PROXY_NAMESPACE,
                    label_selector=",".join(f"{k}={v}" for k, v in match.items()),
                )
        states = node_states(inst, agent_pods, cleanup_pods, marked, kube_proxy_pods, nodes)
        if agents is None and not states and uid not in self._agents_stopped:
            selected = PxcInfo.from_body({"spec": {"nodeSelector": spec.node_selector}})
            states = {
                n: NodeState()
                for n, labels in sorted(nodes.items())
                if selected.selects(labels) and n not in admission.kept_out
            }
        window = resolve_int_or_percent(spec.max_unavailable, max(1, len(states)))
        step = plan(states, window, wait_for_kube_proxy=wait_for_kube_proxy)
        # Progress: a node clean, or a step taken. No progress for cleanup_timeout: give up.
        key = (len(step.done), tuple(sorted(step.waiting.items())))
        last = self._progress.get(uid)
        if last is None or last[0] != key:
            self._progress[uid] = (key, runtime)
        elif not step.finished and runtime - last[1] >= self.config.cleanup_timeout:
            await self._give_up(name, spec, step, emit)
            await self._finish_cleanup(name, states, emit)
            return
        await self._take(name, step, agent_pods, emit)
        if not step.finished:
            raise NotYet(f"cleanup: {waiting_summary(step)}", delay=2)
        emit(
            "Normal",
            "CleanupDone",
            f"Removed the {spec.mode} rules from {len(step.done)} node(s), {window} at a time",
        )
        await self._finish_cleanup(name, states, emit)

    async def _take(self, name: str, step: Plan, agent_pods: list[Obj], emit: EventFn) -> None:
        """The actions of one pass of a node-by-node cleanup."""
        inst = instance(name)
        ns = self.config.build.namespace
        for node in step.begin:
            await self.api.patch("Node", node, None, marks_patch(deleting=inst))
        for node in step.move_back:
            await self.api.patch("Node", node, None, node_label_patch(node, False))
            emit(
                "Normal",
                "KubeProxyMovedBack",
                f"node {node}: label {KUBE_PROXY_OFF_LABEL} removed, so "
                f"{KUBE_PROXY_NAMESPACE}/{KUBE_PROXY_DAEMONSET} comes back to it; its kpx "
                "rules go once kube-proxy is Ready there",
            )
        for node in step.stop_agent:
            for pod in agent_pods:
                if (pod.get("spec") or {}).get("nodeName") == node:
                    await self.api.delete("Pod", str(pod["metadata"]["name"]), ns)
        for node in step.clean:
            await self.api.patch("Node", node, None, marks_patch(deleting=inst, cleanup=inst))

    async def _give_up(
        self, name: str, spec: ProxyConfigurationSpec, step: Plan, emit: EventFn
    ) -> None:
        """No progress for cleanup_timeout: the Warning names the nodes that keep their rules
        (their agents stop in _finish_cleanup)."""
        left = sorted([*step.waiting, *step.pending])
        stuck = "; ".join(f"{n}: {why}" for n, why in sorted(step.waiting.items())[:5])
        emit(
            "Warning",
            "CleanupTimedOut",
            f"No progress for {self.config.cleanup_timeout:.0f}s: {len(step.done)} of "
            f"{step.total} node(s) clean; the {spec.mode} rules stay on {node_list(left)} "
            f"(their agents stopped; run `proxy-agent cleanup --mode {spec.mode}` there)"
            + (f". Waiting: {stuck}" if stuck else ""),
        )

    async def _finish_cleanup(
        self, name: str, states: Mapping[str, NodeState], emit: EventFn
    ) -> None:
        """The end of a Cleanup: any agent Pod left stops (one never scheduled, or on a node
        given up: its rules stay), the children go, and the nodes lose the cleanup labels."""
        ns = self.config.build.namespace
        for pod in await self.api.list("Pod", ns, label_selector=_selector(name, AGENT_APP)):
            await self.api.delete("Pod", str(pod["metadata"]["name"]), ns)
        await self._delete(
            child_refs(name, self.config.build), emit, "its ProxyConfiguration is gone"
        )
        for node in sorted(states):
            try:
                await self.api.patch("Node", node, None, marks_patch())
            except ApiError as exc:  # a node deleted meanwhile
                log.info("%s: cannot remove the cleanup labels of node %s: %s", name, node, exc)
