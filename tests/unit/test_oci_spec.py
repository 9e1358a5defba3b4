"""What a container's securityContext, command and network become in runc's config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from kpx_cluster import oci
from kpx_cluster.oci import ImageConfig, Mount, SecurityContext, SecurityError

AGENT = ImageConfig(("proxy-agent",), (), ("PATH=/opt/kpx/bin:/usr/bin",), "", "/")
OPERATOR = ImageConfig(("proxy-operator",), (), (), "65532:65532", "/")
AGENT_SC = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def spec(image: ImageConfig = AGENT, sc: SecurityContext | None = None, **kw: object) -> dict:
    return oci.runtime_spec(
        Path("/store/rootfs"), ["proxy-agent"], {}, image, sc or SecurityContext(), **kw
    )  # type: ignore[arg-type]


def test_drop_all_then_add_gives_exactly_the_added_capabilities() -> None:
    sc = SecurityContext.from_pod({}, AGENT_SC)
    assert oci.capabilities(sc) == ["CAP_NET_ADMIN"]
    process = spec(sc=sc, netns=None)["process"]
    for kind in ("bounding", "effective", "permitted"):
        assert process["capabilities"][kind] == ["CAP_NET_ADMIN"]
    assert process["noNewPrivileges"] is True
    # Without the add: nothing at all (the test that removes NET_ADMIN relies on it).
    bare = SecurityContext.from_pod({}, {"capabilities": {"drop": ["ALL"]}})
    assert oci.capabilities(bare) == []


def test_default_capabilities_less_drops_and_privileged_gets_all() -> None:
    sc = SecurityContext(caps_drop=("NET_RAW",), caps_add=("NET_ADMIN",))
    caps = oci.capabilities(sc)
    assert "CAP_NET_RAW" not in caps and "CAP_NET_ADMIN" in caps and "CAP_CHOWN" in caps
    privileged = oci.capabilities(SecurityContext(privileged=True, caps_drop=("ALL",)))
    assert {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_BPF"} <= set(privileged)
    # ... every one the runtime has: runc refuses more than its own bounding set (here a
    # machine whose CapBnd lacks CAP_SYS_RESOURCE, bit 24: 000001fffeffffff)
    bounding = oci.caps_of_mask(0x1FFFEFFFFFF)
    assert "CAP_SYS_RESOURCE" not in bounding and len(bounding) == 40
    assert "CAP_CHECKPOINT_RESTORE" in bounding and "CAP_CHOWN" in bounding
    limited = oci.capabilities(SecurityContext(privileged=True), bounding)
    assert set(limited) == bounding
    caps = spec(sc=SecurityContext(privileged=True), netns=None, bounding=bounding)["process"]
    assert caps["capabilities"]["bounding"] == sorted(bounding)
    # Privileged: no masked /proc paths and no seccomp filter.
    full = spec(sc=SecurityContext(privileged=True, seccomp_runtime_default=True), netns=None)
    assert "maskedPaths" not in full["linux"] and "seccomp" not in full["linux"]


def test_user_from_image_or_run_as_user_and_run_as_non_root_refuses_root() -> None:
    assert oci.user_of(SecurityContext(), OPERATOR) == (65532, 65532)
    assert oci.user_of(SecurityContext(run_as_user=1000, run_as_group=5), OPERATOR) == (1000, 5)
    assert oci.user_of(SecurityContext(), AGENT) == (0, 0)
    with pytest.raises(SecurityError, match="runAsNonRoot"):
        oci.user_of(SecurityContext(run_as_non_root=True), AGENT)
    assert oci.user_of(SecurityContext(run_as_non_root=True), OPERATOR) == (65532, 65532)
    # Pod-level fields apply unless the container overrides them.
    sc = SecurityContext.from_pod({"runAsUser": 7, "runAsNonRoot": True}, {"runAsUser": 8})
    assert (sc.run_as_user, sc.run_as_non_root) == (8, True)


def test_command_replaces_entrypoint_and_args_replace_cmd() -> None:
    image = ImageConfig(("/entry",), ("default-arg",), (), "", "/")
    assert oci.process_args(image, [], []) == ["/entry", "default-arg"]
    assert oci.process_args(image, [], ["a"]) == ["/entry", "a"]
    assert oci.process_args(image, ["proxy-agent"], []) == ["proxy-agent"]
    assert oci.process_args(image, ["sh", "-c"], ["x"]) == ["sh", "-c", "x"]
    with pytest.raises(SecurityError, match="no command"):
        oci.runtime_spec(Path("/r"), [], {}, image, SecurityContext(), netns=None)


def test_host_network_joins_no_network_namespace_and_a_pod_joins_its_own() -> None:
    host = spec(netns=None)["linux"]["namespaces"]
    assert all(ns["type"] != "network" for ns in host)
    pod = spec(netns="/var/run/netns/pod-a")["linux"]["namespaces"]
    assert {"type": "network", "path": "/var/run/netns/pod-a"} in pod


def test_read_only_root_env_mounts_and_seccomp() -> None:
    sc = SecurityContext.from_pod({}, {**AGENT_SC, "readOnlyRootFilesystem": True})
    out = oci.runtime_spec(
        Path("/store/rootfs"),
        ["proxy-agent"],
        {"NODE_NAME": "n1", "PATH": "/x"},
        AGENT,
        sc,
        netns=None,
        mounts=[
            Mount("/run/xtables.lock", "/run/xtables.lock"),
            Mount("/etc/cm", "/etc/kpx", read_only=True),
        ],
    )
    assert out["root"] == {"path": "/store/rootfs", "readonly": True}
    assert out["process"]["env"] == ["PATH=/x", "NODE_NAME=n1"]  # the pod's env wins
    binds = {m["destination"]: m["options"] for m in out["mounts"] if m["type"] == "bind"}
    assert binds == {
        "/run/xtables.lock": ["rbind", "rprivate", "rw"],
        "/etc/kpx": ["rbind", "rprivate", "ro"],
    }
    assert out["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
    blocked = out["linux"]["seccomp"]["syscalls"][0]["names"]
    assert "init_module" in blocked and "kexec_load" in blocked
    assert "/proc/sys" in out["linux"]["readonlyPaths"]
    assert "seccomp" not in spec(netns=None)["linux"]  # Unconfined unless asked
