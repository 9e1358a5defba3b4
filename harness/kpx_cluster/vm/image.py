"""The guest image of `proxy-vm`: a Debian root file system with IPVS in its kernel.

Built once with mmdebstrap (Debian packages) and the host's pip (the project's Python
dependencies, as wheels for the guest's Python 3.11), cached under ~/.cache/kpx/vm/<recipe
hash>/ and rebuilt only when the recipe changes: the hash covers the package lists, the Python
requirements (read from pyproject.toml) and the init stub (guest.py itself is read from the
project share at boot). The cache holds vmlinuz, initrd.img and root.img (ext4, booted
read-only with qemu's -snapshot, so several guests can share it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..binaries import cache_dir

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
#: Debian packages in the guest: the kernel (6.1, CONFIG_IP_VS=m), the agent's runtime tools and
#: a real node's runtime.
PACKAGES = (
    "linux-image-amd64",
    "initramfs-tools",
    "kmod",
    "iproute2",
    "nftables",
    "iptables",
    "ipvsadm",
    "conntrack",
    "socat",
    "curl",
    "procps",
    "ca-certificates",
    "python3",
    # Real kubelet nodes in the guest (the ipvs conformance run): the runtime and CNI plugins
    # the host's real nodes use (docs/real-kubelets.md).
    "containerd",
    "runc",
    "containernetworking-plugins",
)
#: Debian bookworm's python3: the Python packages are installed for it by the host's pip.
GUEST_PYTHON = "3.11"
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
#: Python packages beyond the project's own dependencies (the ipvs backend's netlink library is
#: among those; the test runner).
EXTRA_PYTHON = ("pytest>=8", "pytest-timeout>=2.3")
IMAGE_SIZE = "3G"
GUEST_PROGRAM = Path(__file__).with_name("guest.py")
#: The guest's init: mounts the share holding the project (kpx.share.0) and runs guest.py from
#: it (kpx.guest), so the guest program changes without rebuilding the image.
INIT_STUB = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for w in $(cat /proc/cmdline); do
  case "$w" in kpx.guest=*) G="${w#kpx.guest=}";; kpx.share.0=*) S="${w#kpx.share.0=}";; esac
done
modprobe -a 9pnet_virtio 9p
mkdir -p "${S#*:}"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "${S%%:*}" "${S#*:}"
exec /usr/bin/python3 "$G"
"""
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def components(root: Path = PROJECT_ROOT) -> list[str]:
    """The folders of the project's distributions (the root pyproject.toml's workspace)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    return list(pyproject["tool"]["kpx"]["workspace"]["distributions"])


@dataclass(frozen=True)
class Image:
    directory: Path

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    @property
    def root(self) -> Path:
        return self.directory / "root.img"

    def exists(self) -> bool:
        return (self.directory / "done").exists()


def python_requirements(root: Path = PROJECT_ROOT) -> list[str]:
    """The dependencies of the project's pyproject.toml files (the root's and each of its
    distributions': api/, kube/, agents/, ...), minus the project's own packages
    (the guest imports those from the shared source tree)."""
    found: set[str] = set(EXTRA_PYTHON)
    own: set[str] = set()
    for path in [root / "pyproject.toml", *(root / d / "pyproject.toml" for d in components(root))]:
        if path.exists():
            project = tomllib.loads(path.read_text()).get("project", {})
            own.add(str(project.get("name", "")).lower())
            found.update(project.get("dependencies", []))
    return sorted(r for r in found if _requirement_name(r) not in own)


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def recipe() -> dict[str, object]:
    return {
        "suite": SUITE,
        "guest_python": GUEST_PYTHON,
        "wheel_platforms": list(WHEEL_PLATFORMS),
        "packages": list(PACKAGES),
        "python": python_requirements(),
        "init": hashlib.sha256(INIT_STUB.encode()).hexdigest(),
        "size": IMAGE_SIZE,
        "format": 1,
    }


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def vm_cache() -> Path:
    return cache_dir() / "vm"


def current_image() -> Image:
    return Image(vm_cache() / recipe_hash())


def missing_host_tools() -> list[str]:
    return [t for t in ("qemu-system-x86_64", "mmdebstrap", "mke2fs") if not shutil.which(t)]


def build(log=sys.stderr) -> Image:
    """Build the image of the current recipe unless it is cached; returns it. One build at a
    time (a lock in the cache): a second caller waits, then finds the image built."""
    vm_cache().mkdir(parents=True, exist_ok=True)
    with open(vm_cache() / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(log)


def _build(log) -> Image:
    image = current_image()
    if image.exists():
        return image
    missing = missing_host_tools()
    if missing:
        raise RuntimeError(f"proxy-vm needs {', '.join(missing)} (make setup-vm installs them)")
    work = image.directory.with_name(image.directory.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True)
    requirements = work / "requirements.txt"
    requirements.write_text("\n".join(python_requirements()) + "\n")
    (work / "kpx-init").write_text(INIT_STUB)
    env = dict(os.environ)
    print(f"proxy-vm: building the guest image in {image.directory}", file=log, flush=True)
    hooks = [
        f'install -m 0755 {work}/kpx-init "$1/sbin/kpx-init"',
        'echo kpx-vm > "$1/etc/hostname"',
    ]
    argv = [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        f"--include={','.join(PACKAGES)}",
        *(f"--customize-hook={hook}" for hook in hooks),
        SUITE,
        str(rootfs),
        MIRROR,
    ]
    subprocess.run(argv, check=True, env=env, stdout=log, stderr=log)
    # The Python packages, as wheels for the guest's Python, fetched by the host's pip (which
    # knows this machine's index and certificates) straight into the guest's site directory.
    site = rootfs / "usr" / "local" / "lib" / f"python{GUEST_PYTHON}" / "dist-packages"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-compile",
        "--target",
        str(site),
        "--only-binary=:all:",
        "--python-version",
        GUEST_PYTHON,
        "--implementation",
        "cp",
        "--abi",
        f"cp{GUEST_PYTHON.replace('.', '')}",
        *(f"--platform={p}" for p in WHEEL_PLATFORMS),
        "--platform=any",
        "-r",
        str(requirements),
    ]
    subprocess.run(pip, check=True, stdout=log, stderr=log)
    boot = rootfs / "boot"
    kernel = sorted(boot.glob("vmlinuz-*"))[-1]
    initrd = sorted(boot.glob("initrd.img-*"))[-1]
    shutil.copy(kernel, work / "vmlinuz")
    shutil.copy(initrd, work / "initrd.img")
    subprocess.run(
        [
            "mke2fs",
            "-q",
            "-t",
            "ext4",
            "-L",
            "kpxroot",
            "-d",
            str(rootfs),
            str(work / "root.img"),
            IMAGE_SIZE,
        ],
        check=True,
        stdout=log,
        stderr=log,
    )
    shutil.rmtree(rootfs)
    (work / "recipe.json").write_text(json.dumps(recipe(), indent=2, sort_keys=True) + "\n")
    (work / "done").write_text("")
    shutil.rmtree(image.directory, ignore_errors=True)
    work.rename(image.directory)
    for old in vm_cache().iterdir():  # images of older recipes
        if old != image.directory and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return image
