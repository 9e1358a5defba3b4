"""A switch whose new mode cannot run on one node: that node's agent rolls it back by itself.

`switch_with_rollback` (under the load of `kpx_cluster.migration`): spec.modeSwitch
progressDeadlineSeconds set short, nftables refused on one node (`nft_refused`), spec.mode
patched to nftables. It waits until status.modeSwitch shows that node RolledBack, then makes a
change the node must serve through the old mode's rules (a Service created after the rollback,
probed from a pod on that node: only a live agent programs it), and watches the rollout stay
stopped for a while. Then it lifts the refusal and takes the documented way out (delete the
rolled-back agent's Pod: the new one programs nftables), and waits for the switch to finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .migration import (
    BACKEND_PORT,
    NS,
    TCP_PORT,
    LoadOptions,
    MigrationEnv,
    SwitchResult,
    _agent_states,
    _apply,
    _start_load,
    _stop_load,
    mode_rules,
    mode_switch_finished,
    nft_refused,
    wait_rolled_out,
    wait_until,
)
from .migration_load import Summary
from .netns import Node
from .probe import ProbeResult, probe

LATE_SERVICE = "svc-late"


@dataclass
class RollbackResult:
    old: str
    new: str
    refused_node: str
    deadline: int
    #: from the patch of spec.mode to the node shown RolledBack (None: timed out)
    rolled_back_after: float | None
    #: status.modeSwitch and condition ModeSwitch then
    at_rollback: dict[str, Any]
    condition: dict[str, Any]
    #: the RolledBack Event of the node's agent Pod (its message)
    event: str
    #: node -> "mode ready|not ready" of its agent, when RolledBack was seen and `hold` s later
    agents_then: dict[str, str]
    agents_held: dict[str, str]
    #: status.modeSwitch `hold` s after the rollback (the rollout stayed where it was)
    held: dict[str, Any]
    #: the Service created after the rollback: its ClusterIP, how long until the refused node
    #: answered it, the tries from there, and whether the node's iptables rules name it
    late_ip: str
    late_served_after: float | None
    late_probe: ProbeResult | None
    late_in_old_rules: bool
    #: from deleting the rolled-back Pod (after the lift) to the rollout done (None: timed out)
    recovered_after: float | None
    finished: dict[str, Any]
    loads: list[Summary] = field(default_factory=list)

    def traffic_failures(self) -> list[str]:
        return SwitchResult(self.old, self.new, 0, 0.0, self.loads, {}).failures()

    def traffic(self) -> str:
        """The load's figures, as the bench's table counts them."""
        r = SwitchResult(self.old, self.new, len(self.loads), 0.0, self.loads, {})
        return (
            f"{r.total('tcp', 'tried')} new TCP connections / {r.total('tcp', 'failed')} "
            f"failed, {r.total('udp', 'tried')} UDP exchanges / {r.total('udp', 'failed')} "
            f"lost, {r.held_survived} of {r.held} held connections survived, over "
            f"{r.load_seconds:.0f}s"
        )


def _mode_switch(env: MigrationEnv) -> dict[str, Any]:
    return dict(env.json("get", "pxc", env.pxc).get("status", {}).get("modeSwitch") or {})


def _condition(env: MigrationEnv, type_: str) -> dict[str, Any]:
    conditions = env.json("get", "pxc", env.pxc).get("status", {}).get("conditions", [])
    return dict(next((c for c in conditions if c["type"] == type_), {}))


def _phase(switch: dict[str, Any], node: str) -> str:
    return str({n["name"]: n["phase"] for n in switch.get("nodes", [])}.get(node, ""))


def _agent_pod(env: MigrationEnv, node: str) -> dict[str, Any]:
    pods = [
        p
        for p in env.agent_pods()
        if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")
    ]
    return pods[0] if pods else {}


def _rolled_back_event(env: MigrationEnv, pod: str) -> str:
    events = env.json(
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        f"involvedObject.name={pod},reason=RolledBack",
    )
    items = events.get("items", [])
    return str(items[-1].get("message", "")) if items else ""


def _late_service(env: MigrationEnv) -> str:
    _apply(
        env.cluster,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": LATE_SERVICE, "namespace": env.app_ns},
            "spec": {
                "selector": {"app": "web"},
                "ports": [
                    {"name": "tcp", "port": TCP_PORT, "targetPort": BACKEND_PORT, "protocol": "TCP"}
                ],
            },
        },
    )
    return str(
        wait_until(
            lambda: env.service(LATE_SERVICE).get("spec", {}).get("clusterIP"),
            30,
            "the late Service's ClusterIP",
        )
    )


def switch_with_rollback(
    env: MigrationEnv,
    old: str,
    new: str,
    node: Node,
    deadline: int = 10,
    hold: float = 10.0,
    opts: LoadOptions | None = None,
    timeout: float = 180,
    log: Callable[[str], None] = print,
) -> RollbackResult:
    assert new == "nftables", "the injection refuses nftables"
    opts = opts or LoadOptions()
    assert env.rolled_out(old), f"not serving in {old} on every node before the switch"
    env.patch_mode_switch(progressDeadlineSeconds=deadline, rollbackOnFailure=True)
    client = env.clients[env.nodes.index(node)]
    started = _start_load(env, opts)
    rolled_back_after = late_served_after = recovered_after = None
    late_probe: ProbeResult | None = None
    late_ip, event = "", ""
    try:
        time.sleep(opts.warmup)
        with nft_refused(env, node):
            log(
                f"nftables refused on {node.name}; patching spec.mode {old} -> {new} "
                f"(progressDeadlineSeconds {deadline})"
            )
            t0 = time.monotonic()
            env.patch_mode(old, new)
            try:
                wait_until(
                    lambda: _phase(_mode_switch(env), node.name) == "RolledBack",
                    timeout,
                    f"{node.name} RolledBack",
                )
                rolled_back_after = round(time.monotonic() - t0, 1)
            except TimeoutError as err:
                log(str(err))
            at_rollback, condition = _mode_switch(env), _condition(env, "ModeSwitch")
            agents_then = _agent_states(env)
            event = _rolled_back_event(env, _agent_pod(env, node.name)["metadata"]["name"])
            log(
                f"+{rolled_back_after}s {at_rollback.get('summary')}; agents {agents_then}; "
                f"Event RolledBack: {event}"
            )
            # A change after the rollback: served on that node only if its agent programs
            # the old mode's rules live.
            t1 = time.monotonic()
            late_ip = _late_service(env)

            def answered() -> ProbeResult | None:
                got = probe(env.topo, client, late_ip, TCP_PORT, count=1, timeout=0.5)
                return got if got.answered else None

            try:
                wait_until(answered, 30, f"{LATE_SERVICE} answering on {node.name}")
                late_served_after = round(time.monotonic() - t1, 1)
                late_probe = probe(env.topo, client, late_ip, TCP_PORT, count=20, timeout=1.0)
            except TimeoutError as err:
                log(str(err))
            late_in_old_rules = any(late_ip in line for line in mode_rules(env.topo, node, old))
            log(
                f"{LATE_SERVICE} {late_ip} answered on {node.name} {late_served_after}s "
                f"after it was created: {late_probe}; in its {old} rules: "
                f"{late_in_old_rules}"
            )
            time.sleep(max(0.0, hold - (time.monotonic() - t1)))
            held, agents_held = _mode_switch(env), _agent_states(env)
            log(f"{hold:.0f}s later: {held.get('summary')}; agents {agents_held}")
        log(f"refusal lifted on {node.name}; deleting its rolled-back agent Pod")
        t2 = time.monotonic()
        pod = _agent_pod(env, node.name)["metadata"]["name"]
        env.cluster.kubectl("-n", NS, "delete", "pod", pod, "--wait=false")
        recovered_after = wait_rolled_out(
            env, old, new, t2, "after the Pod was replaced", timeout, log
        )
        finished = mode_switch_finished(env, 60, log)
        time.sleep(opts.settle)
    finally:
        loads = _stop_load(started, opts.timeout)
        env.cluster.kubectl(
            "-n", env.app_ns, "delete", "svc", LATE_SERVICE, "--ignore-not-found", check=False
        )
        env.patch_mode_switch(progressDeadlineSeconds=None, rollbackOnFailure=None)
    return RollbackResult(
        old,
        new,
        node.name,
        deadline,
        rolled_back_after,
        at_rollback,
        condition,
        event,
        agents_then,
        agents_held,
        held,
        late_ip,
        late_served_after,
        late_probe,
        late_in_old_rules,
        recovered_after,
        finished,
        loads,
    )
