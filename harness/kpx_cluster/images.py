"""The kpx images: their references (one version, the chart's appVersion) and `make image`.

`python3 -m kpx_cluster.images build` builds images/Containerfile's targets with buildah into
OCI archives in the cache (PROXY_CACHE_DIR or ~/.cache/kpx, under images/), then prints
`image: REF PATH` per image. Where the base image cannot be pulled (no registry reachable),
an equivalent is made from Debian's packages with mmdebstrap and tagged under the base's name.
A build is keyed on a hash of every input file: a second run with no change builds nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .binaries import KUBERNETES_VERSION, MissingBinary, cache_dir, kubernetes_binary

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
CONTAINERFILE: Final = Path("images/Containerfile")
IGNOREFILE: Final = Path("images/Containerfile.dockerignore")
#: The build's context: what images/Containerfile copies (a change elsewhere rebuilds nothing).
CONTEXT_PATHS: Final = ("images", "api", "kube", "agents", "operator")
#: The Containerfile's default base, and the Debian release an equivalent is made from.
BASE_IMAGE: Final = "docker.io/library/debian:bookworm-slim"
BASE_SUITE: Final = "bookworm"
REGISTRY: Final = "ghcr.io/kpx"
#: Upstream kube-proxy's image, for the migration tests: not a kpx image, and not in the kpx
#: images' context (Containerfile.dockerignore leaves its folder out).
KUBE_PROXY_CONTAINERFILE: Final = Path("images/upstream-kube-proxy/Containerfile")
KUBE_PROXY_REF: Final = f"registry.k8s.io/kube-proxy:{KUBERNETES_VERSION}"


@dataclass(frozen=True)
class Image:
    """One image: the Containerfile target it is built from and its reference."""

    name: str  # kpx-agent, kpx-operator
    target: str  # agent, operator
    ref: str  # ghcr.io/kpx/kpx-agent:0.1.0

    def archive(self, images_dir: Path) -> Path:
        return images_dir / f"{self.name}-{self.ref.rsplit(':', 1)[1]}.oci.tar"


def project_version(root: Path = REPO_ROOT) -> str:
    """The one version of the images and the chart: charts/kpx/Chart.yaml's appVersion."""
    for line in (root / "charts/kpx/Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return line.split(":", 1)[1].strip().strip("\"'")
    raise ValueError("charts/kpx/Chart.yaml has no appVersion")


def images(version: str) -> tuple[Image, Image]:
    """The operator and agent images of `version`."""
    return (
        Image("kpx-operator", "operator", f"{REGISTRY}/kpx-operator:{version}"),
        Image("kpx-agent", "agent", f"{REGISTRY}/kpx-agent:{version}"),
    )


def agent_image(root: Path = REPO_ROOT) -> Image:
    return images(project_version(root))[1]


def operator_image(root: Path = REPO_ROOT) -> Image:
    return images(project_version(root))[0]


def images_dir() -> Path:
    return cache_dir() / "images"


def archives_dir() -> Path:
    """Where the tests take the built archives from: $KPX_IMAGES_DIR (archives built elsewhere,
    `build_all(directory=...)`: several work trees on one machine), else images_dir()."""
    override = os.environ.get("KPX_IMAGES_DIR")
    return Path(override) if override else images_dir()


# -- inputs (pure but for reading files) -------------------------------------------------------


def _ignored(rel: str, patterns: Iterable[str]) -> bool:
    parts = rel.split("/")
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(rel, pattern) or any(fnmatch.fnmatch(p, bare) for p in parts):
            return True
    return False


def ignore_patterns(root: Path = REPO_ROOT) -> list[str]:
    lines = (root / IGNOREFILE).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def context_files(root: Path = REPO_ROOT) -> Iterator[Path]:
    """Every file of the build context that the build may copy, in a stable order."""
    patterns = ignore_patterns(root)
    for top in CONTEXT_PATHS:
        path = root / top
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in found:
            if not _ignored(file.relative_to(root).as_posix(), patterns):
                yield file


def inputs_digest(root: Path = REPO_ROOT, base: str = BASE_IMAGE) -> str:
    """A hash of everything a build reads: the base's name and each context file (path, mode,
    content). Equal digests: the archives built before are what a build would produce."""
    digest = hashlib.sha256(f"base {base}\n".encode())
    for file in context_files(root):
        rel = file.relative_to(root).as_posix()
        digest.update(f"{rel} {file.stat().st_mode & 0o111:o}\n".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


# -- building (the edge: buildah, mmdebstrap) --------------------------------------------------


def _storage() -> list[str]:
    """buildah's store: the project's own, in the cache, with the overlay driver (layers shared
    between images; vfs copies every layer in full)."""
    root = cache_dir() / "containers"
    return [
        "--storage-driver",
        "overlay",
        "--root",
        str(root / "storage"),
        "--runroot",
        str(root / "run"),
    ]


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, check=True, **kwargs)  # type: ignore[call-overload]


def _has_image(ref: str) -> bool:
    found = subprocess.run(
        ["buildah", *_storage(), "inspect", "--type", "image", ref],
        capture_output=True,
        check=False,
    )
    return found.returncode == 0


def ensure_base(base: str = BASE_IMAGE, log: bool = True) -> None:
    """The base in buildah's store: pulled, or else made from Debian's packages and tagged
    under the base's name (a minbase without documentation, like Debian's slim images)."""
    if _has_image(base):
        return
    pulled = subprocess.run(
        ["buildah", *_storage(), "pull", "--quiet", base], capture_output=True, check=False
    )
    if pulled.returncode == 0:
        return
    if log:
        print(f"images: {base} cannot be pulled; making it from Debian {BASE_SUITE} packages")
    with tempfile.TemporaryDirectory(prefix="kpx-base-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        _run(
            [
                "mmdebstrap",
                "--quiet",
                # unshare: no mounts in the host's namespace (mode root left /proc mounted
                # when a teardown found it busy)
                "--mode=unshare",
                "--variant=minbase",
                # merged /usr by a hook, not the usrmerge package (which pulls in perl)
                "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                "--dpkgopt=path-exclude=/usr/share/info/*",
                "--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*"
                " $1/var/log/apt $1/var/log/dpkg.log",
                BASE_SUITE,
                str(tarball),
            ]
        )
        container = subprocess.run(
            ["buildah", *_storage(), "from", "scratch"], capture_output=True, text=True, check=True
        ).stdout.strip()
        try:
            _run(
                ["buildah", *_storage(), "add", container, str(tarball), "/"],
                stdout=subprocess.DEVNULL,
            )
            _run(["buildah", *_storage(), "config", "--cmd", "bash", container])
            _run(
                ["buildah", *_storage(), "commit", "--quiet", container, base],
                stdout=subprocess.DEVNULL,
            )
        finally:
            subprocess.run(
                ["buildah", *_storage(), "rm", container], capture_output=True, check=False
            )


def _ca_secret() -> list[str]:
    """The host's CA bundle as the build secret `ca-certificates` (pip's, else OpenSSL's), so
    the build reaches the package index wherever the host does."""
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if (path := os.environ.get(var)) and Path(path).is_file():
            return ["--secret", f"id=ca-certificates,src={path}"]
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return ["--secret", f"id=ca-certificates,src={default}"] if default.is_file() else []


def build(
    image: Image,
    out: Path,
    root: Path = REPO_ROOT,
    base: str = BASE_IMAGE,
    containerfile: Path | None = None,
    context: Path | None = None,
) -> None:
    """Build `image` with buildah (cached layers) and write its OCI archive: the kpx images'
    target of images/Containerfile, or `containerfile` in `context` (no target)."""
    if containerfile is None:
        source = [
            "--file",
            str(root / CONTAINERFILE),
            "--ignorefile",
            str(root / IGNOREFILE),
            "--target",
            image.target,
            str(root),
        ]
    else:
        source = ["--file", str(containerfile), str(context)]
    _run(
        [
            "buildah",
            *_storage(),
            "bud",
            "--quiet",
            "--layers",
            "--pull-never",
            "--isolation",
            "chroot",
            "--build-arg",
            f"BASE={base}",
            *_ca_secret(),
            "--tag",
            image.ref,
            *source,
        ],
        stdout=subprocess.DEVNULL,
    )
    tmp = out.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    _run(["buildah", *_storage(), "push", "--quiet", image.ref, f"oci-archive:{tmp}:{image.ref}"])
    tmp.replace(out)


def _stamp(archive: Path) -> Path:
    return archive.with_name(archive.name + ".inputs")


def up_to_date(image: Image, directory: Path, digest: str) -> bool:
    archive = image.archive(directory)
    stamp = _stamp(archive)
    return archive.is_file() and stamp.is_file() and stamp.read_text().strip() == digest


def build_all(root: Path = REPO_ROOT, directory: Path | None = None) -> list[tuple[Image, Path]]:
    """Build every image whose archive is missing or stale; return (image, archive) for all.
    Into `directory`, else archives_dir() ($KPX_IMAGES_DIR: a work tree's own archives)."""
    directory = directory or archives_dir()
    directory.mkdir(parents=True, exist_ok=True)
    digest = inputs_digest(root)
    built = []
    for image in images(project_version(root)):
        archive = image.archive(directory)
        if not up_to_date(image, directory, digest):
            ensure_base()
            build(image, archive, root)
            _stamp(archive).write_text(digest + "\n")
        built.append((image, archive))
    return built


def kube_proxy_image() -> Image:
    return Image("kube-proxy", "", KUBE_PROXY_REF)


def _kube_proxy_inputs(root: Path) -> dict[str, Path]:
    """The kube-proxy image's build context: name in the context -> file."""
    return {
        "Containerfile": root / KUBE_PROXY_CONTAINERFILE,
        "iptables-wrapper": root / "images" / "iptables-wrapper",
        "kube-proxy": kubernetes_binary("kube-proxy"),
    }


def kube_proxy_digest(root: Path = REPO_ROOT, base: str = BASE_IMAGE) -> str:
    digest = hashlib.sha256(f"base {base}\n".encode())
    for name, file in sorted(_kube_proxy_inputs(root).items()):
        digest.update(f"{name} {file.stat().st_mode & 0o111:o}\n".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def build_kube_proxy(root: Path = REPO_ROOT, directory: Path | None = None) -> Path:
    """Upstream kube-proxy's image from the pinned binary (MissingBinary before `make setup`
    built it), unless its archive is up to date; returns the archive."""
    directory = directory or archives_dir()
    directory.mkdir(parents=True, exist_ok=True)
    image = kube_proxy_image()
    archive = image.archive(directory)
    digest = kube_proxy_digest(root)
    if not up_to_date(image, directory, digest):
        ensure_base()
        with tempfile.TemporaryDirectory(prefix="kpx-kube-proxy-") as tmp:
            context = Path(tmp)
            for name, file in _kube_proxy_inputs(root).items():
                (context / name).write_bytes(file.read_bytes())
                (context / name).chmod(file.stat().st_mode & 0o777)
            build(image, archive, root, containerfile=context / "Containerfile", context=context)
        _stamp(archive).write_text(digest + "\n")
    return archive


def kube_proxy_missing(root: Path = REPO_ROOT, directory: Path | None = None) -> bool:
    directory = directory or archives_dir()
    try:
        digest = kube_proxy_digest(root)
    except MissingBinary:
        return True
    return not up_to_date(kube_proxy_image(), directory, digest)


def missing(root: Path = REPO_ROOT, directory: Path | None = None) -> bool:
    """True when an image's archive is absent or stale (what `make test` checks first)."""
    directory = directory or archives_dir()
    digest = inputs_digest(root)
    return not all(up_to_date(i, directory, digest) for i in images(project_version(root)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kpx_cluster.images")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the images' OCI archives when missing or stale")
    sub.add_parser("list", help="print the images' references and archives as JSON")
    args = parser.parse_args(argv)
    if args.command == "list":
        directory = archives_dir()
        listing = [
            {"ref": i.ref, "archive": str(i.archive(directory))} for i in images(project_version())
        ]
        print(json.dumps(listing))
        return 0
    for image, archive in build_all():
        print(f"image: {image.ref} {archive}")
    try:
        print(f"image: {KUBE_PROXY_REF} {build_kube_proxy()}")
    except MissingBinary as err:  # `make image` before `make setup`: only the migration tests
        print(f"images: not building {KUBE_PROXY_REF}: {err}")  # need it
    return 0


if __name__ == "__main__":
    sys.exit(main())
