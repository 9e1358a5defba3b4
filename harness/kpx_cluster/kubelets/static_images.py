"""Images the real nodes need besides the project's own, built here and never pulled: `pause`
(a static C program, compiled with Debian's gcc), `busybox` (Debian's static busybox with a
link per applet) and `coredns` (toolchain/build-coredns.sh's binary), each written directly
as a single-layer OCI archive whose index carries the `io.containerd.image.name` annotation,
so `ctr -n k8s.io images import` names it.

Archives are cached beside the project's images (PROXY_CACHE_DIR/images), keyed by a digest of
their inputs: a second `ensure` with no change builds nothing. Archives are byte-for-byte
reproducible (fixed mtimes and owners).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..binaries import MissingBinary, cache_dir
from .config import PAUSE_IMAGE
from .dns import COREDNS_IMAGE, COREDNS_VERSION

BUSYBOX_IMAGE: Final = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
BUSYBOX_BINARY: Final = Path("/bin/busybox")  # Debian's busybox-static
#: k8s.io/kubernetes/test/images/agnhost/VERSION of the pinned release (what e2e.test names)
AGNHOST_IMAGE: Final = "registry.k8s.io/e2e-test-images/agnhost:2.63.0"
_FORMAT: Final = "1"  # bump when the archive layout below changes

PAUSE_C: Final = r"""
/* pause: a pod's sandbox process. Sleeps until SIGINT or SIGTERM; reaps orphans. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop}, child = {.sa_handler = on_child,
                                                              .sa_flags = SA_NOCLDSTOP};
    if (getpid() != 1) { /* as upstream: warn, still work */ }
    sigaction(SIGINT, &stop, NULL);
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;) pause();
    return 1;
}
"""

ETC_PASSWD: Final = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"  # noqa: S105 (a file, no secret)
ETC_GROUP: Final = "root:x:0:\nnogroup:x:65534:\n"


@dataclass(frozen=True)
class Entry:
    """One file of a layer: regular (data), directory (data None, no link) or symlink."""

    path: str
    data: bytes | None = None
    mode: int = 0o644
    link: str = ""


def layer_tar(entries: list[Entry]) -> bytes:
    """An uncompressed, reproducible layer: entries in path order, root-owned, mtime 0."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(e.path)
            info.mtime, info.uid, info.gid, info.mode = 0, 0, 0, e.mode
            if e.link:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, e.link, 0o777
                tar.addfile(info)
            elif e.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_archive(ref: str, layer: bytes, config: dict[str, Any]) -> bytes:
    """A single-layer OCI image layout as one tar: oci-layout, index.json (naming `ref`),
    the manifest, the config and the layer under blobs/sha256/."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [_sha(layer)]},
        "history": [{"created_by": "kpx_cluster.kubelets.static_images"}],
    }
    config_blob = json.dumps(image_config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": _sha(config_blob),
            "size": len(config_blob),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": _sha(layer),
                "size": len(layer),
            }
        ],
    }
    manifest_blob = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": _sha(manifest_blob),
                "size": len(manifest_blob),
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1],
                },
            }
        ],
    }
    files = [
        Entry("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
        Entry("index.json", json.dumps(index, sort_keys=True).encode()),
        Entry("blobs", None, 0o755),
        Entry("blobs/sha256", None, 0o755),
    ]
    files += [
        Entry(f"blobs/sha256/{_sha(blob)[7:]}", blob)
        for blob in (manifest_blob, config_blob, layer)
    ]
    return layer_tar(files)


def pause_entries(binary: bytes) -> list[Entry]:
    return [Entry("pause", binary, 0o755)]


def busybox_entries(binary: bytes, applets: list[str]) -> list[Entry]:
    """/bin/busybox, a symlink per applet (`busybox --list-full` paths), /etc/passwd and
    /etc/group, /tmp."""
    dirs = {"bin", "etc", "tmp", "root"}
    links: list[Entry] = []
    for path in applets:
        path = path.strip("/")
        if not path or path == "bin/busybox":
            continue
        parts = path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        links.append(Entry(path, link="/bin/busybox"))
    return [
        *(Entry(d, None, 0o1777 if d == "tmp" else 0o755) for d in sorted(dirs)),
        Entry("bin/busybox", binary, 0o755),
        Entry("etc/passwd", ETC_PASSWD.encode()),
        Entry("etc/group", ETC_GROUP.encode()),
        *links,
    ]


def compile_pause(workdir: Path) -> bytes:
    src, out = workdir / "pause.c", workdir / "pause"
    src.write_text(PAUSE_C)
    subprocess.run(
        ["gcc", "-static", "-Os", "-s", "-o", str(out), str(src)], check=True, capture_output=True
    )
    return out.read_bytes()


@dataclass(frozen=True)
class StaticImage:
    name: str  # archive stem
    ref: str
    inputs: Callable[[], bytes]  # what the archive is built from (its cache key)
    build: Callable[[], bytes]  # the archive's bytes

    def archive(self, directory: Path) -> Path:
        return directory / f"{self.name}-{self.ref.rsplit(':', 1)[1]}.oci.tar"


def _pause_archive() -> bytes:
    with tempfile.TemporaryDirectory(prefix="kpx-pause-") as tmp:
        layer = layer_tar(pause_entries(compile_pause(Path(tmp))))
    return oci_archive(PAUSE_IMAGE, layer, {"Entrypoint": ["/pause"]})


def _busybox_archive() -> bytes:
    listed = subprocess.run(
        [str(BUSYBOX_BINARY), "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    layer = layer_tar(busybox_entries(BUSYBOX_BINARY.read_bytes(), listed))
    return oci_archive(
        BUSYBOX_IMAGE, layer, {"Cmd": ["sh"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
    )


def coredns_binary() -> Path:
    path = cache_dir() / "bin" / f"coredns-{COREDNS_VERSION}" / "coredns"
    if not os.access(path, os.X_OK):
        raise MissingBinary(
            f"coredns {COREDNS_VERSION} is not built ({path} missing): run `make setup` "
            "(or toolchain/build-coredns.sh)"
        )
    return path


def _coredns_inputs() -> bytes:
    return hashlib.sha256(coredns_binary().read_bytes()).digest()


def _coredns_archive() -> bytes:
    entries = [Entry("coredns", coredns_binary().read_bytes(), 0o755), Entry("etc", None, 0o755)]
    return oci_archive(COREDNS_IMAGE, layer_tar(entries), {"Entrypoint": ["/coredns"]})


def _gcc_version() -> bytes:
    done = subprocess.run(["gcc", "--version"], capture_output=True, check=True)
    return bytes(done.stdout)


STATIC_IMAGES: Final = (
    StaticImage("pause", PAUSE_IMAGE, lambda: PAUSE_C.encode() + _gcc_version(), _pause_archive),
    StaticImage("busybox", BUSYBOX_IMAGE, BUSYBOX_BINARY.read_bytes, _busybox_archive),
)
COREDNS: Final = StaticImage("coredns", COREDNS_IMAGE, _coredns_inputs, _coredns_archive)


def images_dir() -> Path:
    return cache_dir() / "images"


def ensure(
    directory: Path | None = None,
    log: Callable[[str], None] = print,
    wanted: tuple[StaticImage, ...] = (*STATIC_IMAGES, COREDNS),
) -> list[Path]:
    """Build each static image's archive unless the cached one has the same inputs."""
    directory = directory or images_dir()
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for image in wanted:
        archive = image.archive(directory)
        stamp = archive.with_name(archive.name + ".inputs")
        digest = hashlib.sha256(_FORMAT.encode() + image.ref.encode() + image.inputs()).hexdigest()
        if not (archive.exists() and stamp.exists() and stamp.read_text().strip() == digest):
            tmp = archive.with_name(archive.name + ".tmp")
            tmp.write_bytes(image.build())
            tmp.replace(archive)
            stamp.write_text(digest + "\n")
            log(f"image: {image.ref} {archive} (built)")
        else:
            log(f"image: {image.ref} {archive}")
        out.append(archive)
    return out


def main() -> int:
    """`make image`: build (or find up to date) the real nodes' images, and the e2e suite's
    (kubelets.debian_images)."""
    from .debian_images import DEBIAN_IMAGES  # it builds on this module

    try:
        ensure()
        ensure(wanted=DEBIAN_IMAGES)
    except MissingBinary as exc:
        print(f"static images: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
