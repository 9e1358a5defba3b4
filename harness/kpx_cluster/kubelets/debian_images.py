"""The e2e suite's images that need a distribution under them, made from Debian's packages
(mmdebstrap, no registry): `agnhost` (the suite's test binary, built by `make setup`, over
what upstream's Alpine image carries (bash, curl, dig, OpenBSD's `nc`, ip, iperf, porter's TLS
pair, /coredns, the image's user and group), GNU wget (Debian's static busybox 1.35 crashes on
`wget -T`, which the specs use) and busybox for every other command),
`regression-issue-74839` (a Conntrack spec's server), `distroless-iptables` (conntrack and
iptables, the KubeProxy CLOSE_WAIT spec's host pod),
`glibc-dns-testing` (the DNS specs' second querier: `dig`, glibc's `getent`, a shell) and
`nginx` (two EndpointSlice/Endpoints specs run it as a plain container).

Each is one layer, the rootfs mmdebstrap writes, in an OCI archive named as `e2e.test` names
the image (`e2e.test --list-images`), cached beside the other images and keyed by its recipe:
a second `ensure` with the same recipe builds nothing. Unlike the static images they are not
byte-for-byte reproducible (Debian's archive moves); the recipe pins the suite and packages.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..binaries import KUBERNETES_VERSION, kubernetes_binary
from .static_images import AGNHOST_IMAGE, BUSYBOX_BINARY, StaticImage, coredns_binary, oci_archive

SUITE: Final = "bookworm"
GLIBC_DNS_TESTING_IMAGE: Final = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.0.0"
NGINX_IMAGE: Final = "registry.k8s.io/e2e-test-images/nginx:1.15-4"
REGRESSION_IMAGE: Final = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.4"
DISTROLESS_IPTABLES_IMAGE: Final = "registry.k8s.io/build-image/distroless-iptables:v0.9.3"


@dataclass(frozen=True)
class Recipe:
    ref: str
    packages: tuple[str, ...]
    config: dict[str, Any]
    customize: tuple[str, ...] = ()  # mmdebstrap --customize-hook commands ($1 is the rootfs)
    files: tuple[tuple[Path, str], ...] = ()  # (host file, path in the image), uploaded first

    def inputs(self) -> bytes:
        digests = [hashlib.sha256(src.read_bytes()).hexdigest() for src, _ in self.files]
        recipe = (SUITE, self.ref, self.packages, self.config, self.customize, self.files)
        return repr((recipe, digests)).encode()


#: busybox's applets, linked where the packages left no command of that name
BUSYBOX_LINKS: Final = (
    'for a in $(chroot "$1" /bin/busybox --list-full); do '
    '[ -e "$1/$a" ] || [ -L "$1/$a" ] || ln -s /bin/busybox "$1/$a"; done'
)


PORTER_DIR: Final = "test/images/agnhost/porter"  # localhost.crt and .key, in the module


def _kubernetes_module_file(relative: str) -> Path:
    """A file of the pinned k8s.io/kubernetes module (downloaded by `make setup`)."""
    gomodcache = subprocess.run(
        ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return Path(gomodcache) / f"k8s.io/kubernetes@{KUBERNETES_VERSION}" / relative


def agnhost_recipe() -> Recipe:
    """As upstream's Dockerfile (test/images/agnhost): its packages, porter's TLS pair,
    /coredns, /uploads, the `agnhost-2` link, the user and group the specs look for."""
    return Recipe(
        AGNHOST_IMAGE,
        ("bash", "curl", "wget", "bind9-dnsutils", "netcat-openbsd", "iproute2", "iperf"),
        {
            "Entrypoint": ["/agnhost"],
            "Cmd": ["pause"],
            "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "ExposedPorts": {f"{p}/tcp": {} for p in (80, 8080, 8081, 9376, 5000)},
        },
        (
            BUSYBOX_LINKS,
            "mkdir -p $1/uploads",
            "ln -s agnhost $1/agnhost-2",
            "chroot $1 groupadd -g 50000 group-defined-in-image",
            "chroot $1 useradd -u 1000 -G group-defined-in-image user-defined-in-image",
        ),
        (
            (kubernetes_binary("agnhost"), "/agnhost"),
            (BUSYBOX_BINARY, "/bin/busybox"),
            (coredns_binary(), "/coredns"),
            (_kubernetes_module_file(f"{PORTER_DIR}/localhost.crt"), "/localhost.crt"),
            (_kubernetes_module_file(f"{PORTER_DIR}/localhost.key"), "/localhost.key"),
        ),
    )


def regression_issue_74839_recipe() -> Recipe:
    """The Conntrack spec's "boom server" (test/images/regression-issue-74839) on Debian, as
    upstream's debian-base."""
    return Recipe(
        REGRESSION_IMAGE,
        (),
        {"Entrypoint": ["/regression-issue-74839"]},
        (),
        ((kubernetes_binary("regression-issue-74839"), "/regression-issue-74839"),),
    )


GLIBC_DNS_TESTING: Final = Recipe(
    GLIBC_DNS_TESTING_IMAGE,
    ("bind9-dnsutils",),
    {"Cmd": ["/bin/sh"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
)
NGINX: Final = Recipe(
    NGINX_IMAGE,
    ("nginx-light",),
    {
        "Cmd": ["nginx", "-g", "daemon off;"],
        "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        "ExposedPorts": {"80/tcp": {}},
    },
    # as upstream's image: logs to the container's stdout and stderr
    (
        "ln -sf /dev/stdout $1/var/log/nginx/access.log",
        "ln -sf /dev/stderr $1/var/log/nginx/error.log",
    ),
)

#: the KubeProxy CLOSE_WAIT spec's host pod: `conntrack -L` (upstream's is distroless with
#: iptables and conntrack; the spec also runs sh, test, which, grep and sleep in it)
DISTROLESS_IPTABLES: Final = Recipe(
    DISTROLESS_IPTABLES_IMAGE,
    ("conntrack", "iptables"),
    {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
)


def mmdebstrap_argv(recipe: Recipe, tarball: Path) -> list[str]:
    return [
        "mmdebstrap",
        "--quiet",
        "--mode=unshare",  # no mounts in the host's namespace
        "--variant=minbase",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *([f"--include={','.join(recipe.packages)}"] if recipe.packages else []),
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*",
        *(f"--customize-hook=upload {src} {dst}" for src, dst in recipe.files),
        *(f"--customize-hook=chmod 0755 $1{dst}" for _, dst in recipe.files),
        *(f"--customize-hook={hook}" for hook in recipe.customize),
        SUITE,
        str(tarball),
    ]


def build(recipe: Recipe) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kpx-debian-image-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(mmdebstrap_argv(recipe, tarball), check=True, capture_output=True)
        return oci_archive(recipe.ref, tarball.read_bytes(), recipe.config)


def static_image(name: str, recipe: Recipe) -> StaticImage:
    return StaticImage(name, recipe.ref, recipe.inputs, lambda: build(recipe))


class _LazyRecipe:
    """A recipe made when first needed (the agnhost binary may not be built at import)."""

    def __init__(self, make: Callable[[], Recipe]) -> None:
        self.make = make

    def inputs(self) -> bytes:
        return self.make().inputs()

    def build(self) -> bytes:
        return build(self.make())


_AGNHOST = _LazyRecipe(agnhost_recipe)
AGNHOST: Final = StaticImage("agnhost", AGNHOST_IMAGE, _AGNHOST.inputs, _AGNHOST.build)
_REGRESSION = _LazyRecipe(regression_issue_74839_recipe)
REGRESSION: Final = StaticImage(
    "regression-issue-74839", REGRESSION_IMAGE, _REGRESSION.inputs, _REGRESSION.build
)


DEBIAN_IMAGES: Final = (
    AGNHOST,
    REGRESSION,
    static_image("glibc-dns-testing", GLIBC_DNS_TESTING),
    static_image("nginx", NGINX),
    static_image("distroless-iptables", DISTROLESS_IPTABLES),
)
