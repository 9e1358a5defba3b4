"""Setting spec.mode back while a node is stuck in a switch: the agents roll back, that node too.

`revert_while_stuck` (under the load of `kpx_cluster.migration`), with
spec.modeSwitch.rollbackOnFailure false (so the node is Stuck, not rolled back by its agent):
refuse nftables on one node (`nft_refused`), switch spec.mode to nftables, wait until
status.modeSwitch shows that node Stuck, then set spec.mode back, and wait until every node
serves in the old mode again - all while the refusal holds (the refusing table is owned by
the refusing process, not an nftables leftover of kpx's: the agents leave it) - then lift it
and wait for the switch back to finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .migration import (
    LoadOptions,
    MigrationEnv,
    SwitchResult,
    _start_load,
    _stop_load,
    mode_switch_finished,
    nft_refused,
    wait_until,
)
from .migration_load import Summary
from .netns import Node


@dataclass
class RevertResult:
    old: str
    new: str
    refused_node: str
    #: status.modeSwitch when the refused node was Stuck (the switch to `new`)
    stuck: dict[str, Any]
    #: from setting spec.mode back to every node serving in `old` again (None: timed out)
    rolled_back_after: float | None
    #: status.modeSwitch (the switch back) then, with the refusal still held
    back: dict[str, Any]
    #: status.modeSwitch once the switch back finished after the lift
    finished: dict[str, Any]
    loads: list[Summary] = field(default_factory=list)

    def traffic_failures(self) -> list[str]:
        return SwitchResult(self.old, self.new, 0, 0.0, self.loads, {}).failures()


def _mode_switch(env: MigrationEnv) -> dict[str, Any]:
    return dict(env.json("get", "pxc", env.pxc).get("status", {}).get("modeSwitch") or {})


def _stuck(env: MigrationEnv, node: str, to: str) -> dict[str, Any] | None:
    got = _mode_switch(env)
    phases = {n["name"]: n["phase"] for n in got.get("nodes", [])}
    return got if got.get("toMode") == to and phases.get(node) == "Stuck" else None


def revert_while_stuck(
    env: MigrationEnv,
    old: str,
    new: str,
    node: Node,
    opts: LoadOptions | None = None,
    timeout: float = 180,
    log: Callable[[str], None] = print,
) -> RevertResult:
    assert new == "nftables", "the injection refuses nftables"
    opts = opts or LoadOptions()
    assert env.rolled_out(old), f"not serving in {old} on every node before the switch"
    # The user's way out when nothing rolls the node back by itself (Stuck after 10 s).
    env.patch_mode_switch(progressDeadlineSeconds=10, rollbackOnFailure=False)
    started = _start_load(env, opts)
    rolled_back_after: float | None = None
    try:
        time.sleep(opts.warmup)
        with nft_refused(env, node):
            log(f"nftables refused on {node.name}; patching spec.mode {old} -> {new}")
            env.patch_mode(old, new)
            stuck = wait_until(
                lambda: _stuck(env, node.name, new),
                timeout,
                f"{node.name} Stuck in status.modeSwitch",
            )
            log(f"stuck: {stuck.get('summary')}; setting spec.mode back to {old}")
            t0 = time.monotonic()
            env.patch_mode(new, old)
            try:
                wait_until(lambda: env.rolled_out(old), timeout, f"every node back in {old}")
                rolled_back_after = round(time.monotonic() - t0, 1)
                log(f"every node serves in {old} again {rolled_back_after}s after the revert")
            except TimeoutError as err:
                log(str(err))
            back = _mode_switch(env)
            log(f"status.modeSwitch with the refusal held: {back.get('summary')}")
        log(f"refusal lifted on {node.name}")
        finished = mode_switch_finished(env, timeout, log)
        time.sleep(opts.settle)
    finally:
        loads = _stop_load(started, opts.timeout)
        env.patch_mode_switch(progressDeadlineSeconds=None, rollbackOnFailure=None)
    return RevertResult(old, new, node.name, stuck, rolled_back_after, back, finished, loads)
