"""A real node inside the proxy-vm guest: the guest's half of `RealCluster(vm=...)`.

    python3 -m kpx_cluster.vm.guest_node SPEC.json      (run in the guest by proxy-vm exec)

The host made the node's fabric link: a tap device on the fabric bridge, which is the guest NIC
with the spec's MAC. This program makes the node's network namespace around that NIC, as
`Topology.add_node` makes a host node's (`netns.node_link_commands`, the node sysctls, routes to
the other nodes' pod CIDRs), creates the node's data directory on the guest's own disk (the
overlayfs snapshotter cannot sit on a 9p share) and its cgroup, then becomes the node's
supervisor in the node's netns and a fresh mount and UTS namespace, as the host runs its own
nodes (kubelets.supervisor: containerd, the images, the kubelet; it prints `ready`).

The spec (JSON, written by the host in the shared state directory):
{"netns", "mac", "fabricIf", "sysctls": [...], "linkCommands": [[ip args]...],
 "routes": [[ip args]...], "dirs": [...], "files": {path: text}, "runtimeCgroup",
 "supervisorSpec": path}

Making the image disk the nodes start from (kubelets.cluster, `guest_images`) uses two other
forms: {"importOnly": true, "dirs", "supervisorSpec"} runs the supervisor in a fresh mount
namespace only (it imports, then stops: no netns, no kubelet), and {"copyStore": [from, to]}
copies one node's containerd root to another's (`cp -a`: the store's paths are relative).
Both print `imported` when done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..kubelets import cgroups
from ..kubelets.config import supervisor_argv

BRIDGE_NF = ("net.bridge.bridge-nf-call-iptables=1", "net.bridge.bridge-nf-call-ip6tables=1")


class GuestNodeError(RuntimeError):
    pass


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise GuestNodeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def nic_with_mac(mac: str, sys_class_net: Path = Path("/sys/class/net")) -> str:
    """The name of the interface whose MAC is `mac` (in this netns)."""
    for entry in sorted(sys_class_net.iterdir()):
        try:
            if (entry / "address").read_text().strip().lower() == mac.lower():
                return entry.name
        except OSError:
            continue
    raise GuestNodeError(f"no interface has MAC {mac}")


def make_netns(spec: dict[str, Any]) -> None:
    ns = spec["netns"]
    _run("modprobe", "-a", "br_netfilter", "veth", "bridge", "ip_vs")
    _run("ip", "netns", "add", ns)
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *spec["sysctls"], *BRIDGE_NF)
    nic = nic_with_mac(spec["mac"])
    _run("ip", "link", "set", "dev", nic, "netns", ns)
    _run("ip", "-n", ns, "link", "set", "dev", nic, "name", spec["fabricIf"])
    for args in [*spec["linkCommands"], *spec["routes"]]:
        _run("ip", "-n", ns, *args)


def _image_store_step(spec: dict[str, Any]) -> int:
    if "copyStore" in spec:
        source, target = spec["copyStore"]
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        _run("cp", "-a", source, target)
        print("imported", flush=True)
        return 0
    for d in spec["dirs"]:
        Path(d).mkdir(parents=True, exist_ok=True)
    unshare = ["unshare", "--mount", "--uts", "--propagation", "private", "--"]
    supervisor = [sys.executable, "-m", "kpx_cluster.kubelets.supervisor", spec["supervisorSpec"]]
    os.execvp("unshare", [*unshare, *supervisor])  # noqa: S606 (a fixed argv: no shell)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("importOnly") or "copyStore" in spec:
        try:
            return _image_store_step(spec)
        except (GuestNodeError, OSError) as exc:
            print(f"image store: {exc}", file=sys.stderr, flush=True)
            return 1
    try:
        make_netns(spec)
        for d in spec["dirs"]:
            Path(d).mkdir(parents=True, exist_ok=True)
        for path, text in spec["files"].items():
            Path(path).write_text(text)
        cgroups.create(spec["runtimeCgroup"])
        cgroups.join(spec["runtimeCgroup"])
    except (GuestNodeError, OSError) as exc:
        print(f"guest node {spec['netns']}: {exc}", file=sys.stderr, flush=True)
        return 1
    argv = supervisor_argv(spec["netns"], Path(spec["supervisorSpec"]), sys.executable)
    os.execvp(argv[0], argv)  # noqa: S606 (a fixed argv: no shell)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
