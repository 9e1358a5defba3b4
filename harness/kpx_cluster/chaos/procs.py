"""The processes of a pod's containers: what a kubelet's SIGKILL or SIGSTOP of the container
reaches. On real kubelets, the processes in each container's cgroup (cgroupfs:
`<node>/kubepods/[<qos>/]pod<uid>/<container id>`), the sandbox's pause left out; on the node
simulator, the descendants of each container's `runc run`."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from kpx_cluster.kubelets import cgroups
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


def container_cgroups(pod: dict[str, Any]) -> list[Path]:
    """The cgroup directories of `pod`'s running containers (one hierarchy's: every v1
    controller holds the same processes); the pause sandbox is not a container of the pod."""
    uid = pod.get("metadata", {}).get("uid")
    ids = [
        s["containerID"].partition("://")[2]
        for s in pod.get("status", {}).get("containerStatuses", [])
        if s.get("containerID") and "running" in s.get("state", {})
    ]
    if not uid or not ids:
        return []
    for root in cgroups.hierarchies():
        if root.name == "unified":  # cgroupfs under the v1 hybrid: the v1 trees hold pods
            continue
        found = [p for cid in ids for p in root.glob(f"*/kubepods/**/pod{uid}/{cid}")]
        if found:
            return found
    return []


def cgroup_pids(paths: list[Path]) -> list[int]:
    pids = []
    for path in paths:
        with contextlib.suppress(OSError):
            pids += [int(w) for w in (path / "cgroup.procs").read_text().split()]
    return pids


def pod_pids(env: MigrationEnv, namespace: str, name: str) -> list[int]:
    """The processes of pod `namespace/name`'s containers."""
    if env.real_nodes:
        return cgroup_pids(container_cgroups(env.json("-n", namespace, "get", "pod", name)))
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


#: How long a killed container may take to be restarted: a real kubelet's CrashLoopBackOff
#: doubles from 10 s up to 300 s while the container keeps dying.
RESTART_TIMEOUT = 330.0


def restart_agent(env: MigrationEnv, node: Node, timeout: float = RESTART_TIMEOUT) -> None:
    """SIGKILL the agent on `node` and wait until the kubelet restarted it."""
    pod = agent_pod(env, node)
    before = restart_count(env, NS, pod)
    signal_all(pod_pids(env, NS, pod), signal.SIGKILL)
    wait_until(lambda: restart_count(env, NS, pod) > before, timeout, f"{pod} restarted")
