"""Run containers from the kpx images with runc: an image store and OCI runtime specs.

`ImageStore` unpacks an OCI archive (what `make image` writes) once per image digest into a
root filesystem that every container of that image shares read-only. `runtime_spec` (pure)
turns what a pod asks for (command, env, user, capabilities, read-only root, network namespace,
mounts) into the bundle's config.json; `run` runs a bundle with runc and waits for it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

Obj = dict[str, Any]

#: What runc's own default spec keeps for an unprivileged container (the Docker/containerd
#: default set): what "drop nothing" means for a pod without a capabilities field.
DEFAULT_CAPS: Final = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
#: Paths of /proc a non-privileged container sees masked or read-only (containerd's lists).
MASKED: Final = (
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
READONLY: Final = (
    "/proc/asound",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about running it (its OCI config)."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[str, ...]
    user: str
    workdir: str


@dataclass(frozen=True)
class Unpacked:
    """An image unpacked in the store: its manifest digest, root filesystem and config."""

    digest: str
    rootfs: Path
    config: ImageConfig


def archive_refs(archive: Path) -> dict[str, str]:
    """ref name -> manifest digest, from an OCI archive's index.json."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ValueError(f"{archive}: no index.json")
        index = json.load(member)
    return {
        m.get("annotations", {}).get("org.opencontainers.image.ref.name", ""): m["digest"]
        for m in index.get("manifests", [])
    }


def image_config(config: Mapping[str, Any]) -> ImageConfig:
    """The parts of an OCI image config (its `config` object) a runtime uses."""
    return ImageConfig(
        entrypoint=tuple(config.get("Entrypoint") or ()),
        cmd=tuple(config.get("Cmd") or ()),
        env=tuple(config.get("Env") or ()),
        user=str(config.get("User") or ""),
        workdir=str(config.get("WorkingDir") or "/"),
    )


class ImageStore:
    """Images unpacked once per digest under `root`, by reference (`load` first)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refs: dict[str, Path] = {}  # ref -> archive

    def load(self, archive: Path, *refs: str) -> list[str]:
        """Make the archive's images known by their names (and by `refs`, extra names for the
        archive's only image, as `docker tag` would). Returns every name now known."""
        names = [n for n in archive_refs(archive) if n]
        for name in [*names, *refs]:
            self.refs[name] = archive
        return [*names, *refs]

    def prune(self) -> None:
        """Remove unpacked images that no loaded archive holds any more (older builds)."""
        wanted = {
            d.replace(":", "-")
            for archive in set(self.refs.values())
            for d in archive_refs(archive).values()
        }
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.name not in wanted and not entry.name.startswith(".unpack-"):
                    shutil.rmtree(entry, ignore_errors=True)

    def unpack(self, ref: str) -> Unpacked:
        """The image `ref`, unpacked (once per digest); KeyError when no archive names it."""
        archive = self.refs[ref]
        digests = archive_refs(archive)
        digest = digests.get(ref) or next(iter(digests.values()))
        target = self.root / digest.replace(":", "-")
        if not (target / "rootfs").is_dir():
            self._unpack(archive, digest, target)
        config = json.loads((target / "config.json").read_text())
        return Unpacked(digest, target / "rootfs", image_config(config.get("config", {})))

    def _unpack(self, archive: Path, digest: str, target: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".unpack-") as tmp:
            layout, bundle = Path(tmp) / "layout", Path(tmp) / "bundle"
            with tarfile.open(archive) as tar:
                tar.extractall(layout, filter="tar")
            # umoci names images by a tag of the layout's index: give this digest one.
            index = json.loads((layout / "index.json").read_text())
            index["manifests"] = [
                {**m, "annotations": {"org.opencontainers.image.ref.name": "run"}}
                for m in index["manifests"]
                if m["digest"] == digest
            ]
            (layout / "index.json").write_text(json.dumps(index))
            subprocess.run(
                ["umoci", "unpack", "--image", f"{layout}:run", str(bundle)],
                check=True,
                capture_output=True,
            )
            manifest = json.loads((layout / "blobs" / digest.replace(":", "/")).read_text())
            blob = layout / "blobs" / manifest["config"]["digest"].replace(":", "/")
            shutil.copy(blob, bundle / "config.json")  # the image's config, not runc's
            bundle.rename(target)


# -- runtime specs (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """A bind mount of a host path into the container."""

    source: str
    destination: str
    read_only: bool = False


@dataclass(frozen=True)
class SecurityContext:
    """A container's securityContext, as far as the runtime enforces it."""

    run_as_user: int | None = None
    run_as_group: int | None = None
    run_as_non_root: bool = False
    privileged: bool = False
    read_only_root: bool = False
    allow_privilege_escalation: bool = True
    caps_add: tuple[str, ...] = ()
    caps_drop: tuple[str, ...] = ()
    seccomp_runtime_default: bool = False

    @classmethod
    def from_pod(
        cls, pod_sc: Mapping[str, Any], container_sc: Mapping[str, Any]
    ) -> SecurityContext:
        """The container's securityContext over the pod's (the container's fields win)."""

        def get(key: str) -> Any:
            return container_sc.get(key, pod_sc.get(key))

        caps = container_sc.get("capabilities") or {}
        seccomp = container_sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        return cls(
            run_as_user=get("runAsUser"),
            run_as_group=get("runAsGroup"),
            run_as_non_root=bool(get("runAsNonRoot")),
            privileged=bool(container_sc.get("privileged")),
            read_only_root=bool(container_sc.get("readOnlyRootFilesystem")),
            allow_privilege_escalation=container_sc.get("allowPrivilegeEscalation", True),
            caps_add=tuple(caps.get("add") or ()),
            caps_drop=tuple(caps.get("drop") or ()),
            seccomp_runtime_default=seccomp.get("type") == "RuntimeDefault",
        )


class SecurityError(ValueError):
    """A securityContext the kubelet refuses (CreateContainerConfigError)."""


def capabilities(sc: SecurityContext, bounding: Iterable[str] | None = None) -> list[str]:
    """The container's capability set: when privileged, every one the runtime itself may give
    (`bounding`: its own bounding set, as containerd gives a privileged container the
    capabilities it has; None: all), else the runtime's default set less `drop` (ALL drops
    every one) plus `add`."""
    if sc.privileged:
        return sorted(_ALL_CAPS if bounding is None else _ALL_CAPS & set(bounding))
    dropped = {_cap(c) for c in sc.caps_drop}
    kept = set() if "CAP_ALL" in dropped else set(DEFAULT_CAPS) - dropped
    return sorted(kept | {_cap(c) for c in sc.caps_add})


def _cap(name: str) -> str:
    name = name.upper()
    return name if name.startswith("CAP_") else f"CAP_{name}"


#: Every capability, by number (one word each: more readable than 41 quoted strings).
_CAPS_BY_NUMBER: Final = tuple(
    _cap(c)
    for c in (  # noqa: SIM905
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
        "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
        "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
        "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
        "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
        "CHECKPOINT_RESTORE"
    ).split()
)
_ALL_CAPS: Final = frozenset(_CAPS_BY_NUMBER)


def caps_of_mask(mask: int) -> frozenset[str]:
    """The capabilities of a mask as /proc/PID/status prints it (CapBnd: hex, bit N = cap N)."""
    return frozenset(c for n, c in enumerate(_CAPS_BY_NUMBER) if mask >> n & 1)


def own_bounding_set() -> frozenset[str]:
    """This process's bounding set (runc gives a container no more; asking for more fails
    with "unable to apply caps: operation not permitted")."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return caps_of_mask(int(line.split()[1], 16))
    return _ALL_CAPS


def user_of(sc: SecurityContext, image: ImageConfig) -> tuple[int, int]:
    """(uid, gid) the process runs as: runAsUser/Group over the image's numeric USER.
    runAsNonRoot with uid 0 is refused, as the kubelet does."""
    image_uid, _, image_gid = image.user.partition(":")
    if image_uid and not image_uid.isdigit():
        raise SecurityError(f"image user {image.user!r} is not numeric")
    uid = sc.run_as_user if sc.run_as_user is not None else int(image_uid or 0)
    gid = sc.run_as_group if sc.run_as_group is not None else int(image_gid or 0)
    if sc.run_as_non_root and uid == 0:
        raise SecurityError("container has runAsNonRoot and image will run as root")
    return uid, gid


def process_args(image: ImageConfig, command: Sequence[str], args: Sequence[str]) -> list[str]:
    """What runs, as the kubelet decides: command replaces the entrypoint (and drops the
    image's cmd), args replace the cmd."""
    if command:
        return [*command, *args]
    return [*image.entrypoint, *(args or image.cmd)]


def runtime_spec(
    rootfs: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
    image: ImageConfig,
    sc: SecurityContext,
    *,
    netns: str | None,
    mounts: Iterable[Mount] = (),
    hostname: str = "container",
    cwd: str | None = None,
    bounding: Iterable[str] | None = None,
) -> Obj:
    """The OCI runtime config.json of one container. `netns`: a network namespace path to join,
    or None for the host's (hostNetwork)."""
    if not argv:
        raise SecurityError("no command: the image has no entrypoint or cmd and the pod none")
    uid, gid = user_of(sc, image)
    caps = capabilities(sc, bounding)
    image_env = dict(e.split("=", 1) for e in image.env if "=" in e)
    namespaces: list[Obj] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if netns is not None:
        namespaces.append({"type": "network", "path": netns})
    spec_mounts: list[Obj] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        # Scratch space a read-only image still needs (what an emptyDir would give).
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"],
        },
    ]
    for m in mounts:
        options = ["rbind", "rprivate", "ro" if m.read_only else "rw"]
        spec_mounts.append(
            {"destination": m.destination, "type": "bind", "source": m.source, "options": options}
        )
    linux: Obj = {"namespaces": namespaces}
    if not sc.privileged:
        linux["maskedPaths"] = list(MASKED)
        linux["readonlyPaths"] = list(READONLY)
    if sc.seccomp_runtime_default and not sc.privileged:
        linux["seccomp"] = RUNTIME_DEFAULT_SECCOMP
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": list(argv),
            "env": [f"{k}={v}" for k, v in {**image_env, **env}.items()],
            "cwd": cwd or image.workdir or "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")}
            | {"ambient": caps if uid != 0 else [], "inheritable": caps if uid != 0 else []},
            "noNewPrivileges": not sc.allow_privilege_escalation,
        },
        "root": {"path": str(rootfs), "readonly": sc.read_only_root},
        "hostname": hostname,
        "mounts": spec_mounts,
        "linux": linux,
    }


#: RuntimeDefault: allow everything but what containerd's default profile blocks for a
#: container without CAP_SYS_ADMIN, as far as these tests need (the kernel keyring, mount
#: namespace games, kernel modules, clock changes, reboots).
RUNTIME_DEFAULT_SECCOMP: Final[Obj] = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "syscalls": [
        {
            "names": [
                "add_key",
                "keyctl",
                "request_key",
                "init_module",
                "finit_module",
                "delete_module",
                "kexec_load",
                "kexec_file_load",
                "reboot",
                "settimeofday",
                "clock_settime",
                "adjtimex",
                "open_by_handle_at",
                "bpf",
                "userfaultfd",
                "unshare",
                "setns",
                "mount",
                "umount2",
                "pivot_root",
                "swapon",
                "swapoff",
                "acct",
            ],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 1,
        }
    ],
}


# -- running (the edge) ------------------------------------------------------------------------


@dataclass
class Bundle:
    """A container bundle directory holding config.json."""

    path: Path
    spec: Obj = field(default_factory=dict)

    def write(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.json").write_text(json.dumps(self.spec, indent=1))


@contextlib.contextmanager
def writable_root(image_rootfs: Path, scratch: Path) -> Iterator[Path]:
    """The shared image root with a container's own writable layer over it (overlayfs), as a
    runtime gives a container without readOnlyRootFilesystem; removed afterwards."""
    upper, work, merged = scratch / "upper", scratch / "work", scratch / "merged"
    for path in (upper, work, merged):
        path.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={image_rootfs},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        yield merged
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def run(
    bundle: Bundle, container_id: str, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`runc run` the bundle in the foreground and wait for it (output captured). A root that
    is not read-only gets its own writable layer: the image's rootfs stays shared, unchanged."""
    with contextlib.ExitStack() as stack:
        root = bundle.spec["root"]
        if not root["readonly"]:
            merged = stack.enter_context(writable_root(Path(root["path"]), bundle.path / "layer"))
            bundle.spec = {**bundle.spec, "root": {**root, "path": str(merged)}}
        bundle.write()
        try:
            return subprocess.run(
                ["runc", "run", "--bundle", str(bundle.path), container_id],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        finally:
            subprocess.run(
                ["runc", "delete", "--force", container_id], capture_output=True, check=False
            )
    raise AssertionError("unreachable")
