"""The processes of simulated pods (under runc: the descendants of each container's
`runc run`, which is what a kubelet's SIGKILL or SIGSTOP of the container reaches)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from kpx_cluster.migration import NS, MigrationEnv, wait_until
from kpx_cluster.netns import Node


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def pod_pids(env: MigrationEnv, namespace: str, name: str) -> list[int]:
    """The processes of pod `namespace/name`'s containers (under runc: below `runc run`)."""
    found = env.simulator().pod(namespace, name)
    if found is None:
        return []
    return [p for top in found.pids.values() for p in descendants(top)]


def agent_pod(env: MigrationEnv, node: Node) -> str:
    for pod in env.agent_pods():
        if pod["spec"]["nodeName"] == node.name and not pod["metadata"].get("deletionTimestamp"):
            return str(pod["metadata"]["name"])
    raise RuntimeError(f"no agent pod on {node.name}")


def signal_all(pids: list[int], sig: int) -> int:
    sent = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            sent += 1
    return sent


def restart_count(env: MigrationEnv, namespace: str, name: str) -> int:
    pod = env.json("-n", namespace, "get", "pod", name)
    return sum(
        int(c.get("restartCount", 0)) for c in pod.get("status", {}).get("containerStatuses", [])
    )


def restart_agent(env: MigrationEnv, node: Node, timeout: float = 120) -> None:
    """SIGKILL the agent on `node` and wait until the kubelet restarted it."""
    pod = agent_pod(env, node)
    before = restart_count(env, NS, pod)
    signal_all(pod_pids(env, NS, pod), signal.SIGKILL)
    wait_until(lambda: restart_count(env, NS, pod) > before, timeout, f"{pod} restarted")
