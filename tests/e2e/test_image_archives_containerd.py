"""The archives `make image` writes load into containerd the way `kind load image-archive` loads
them onto a kind node: `ctr --namespace=k8s.io images import --all-platforms --digests
--snapshotter=overlayfs -` with the archive on stdin (kind's LoadImageArchive, the snapshotter
the node's containerd configures).

The containerd is the test's own (Debian's package, `make setup` installs it): its root, state,
socket and every other path under a temporary directory, nothing system-wide, stopped at the end.
After the import, `ctr images ls` lists each reference of the repository's one version at the
archive's manifest digest, its layers unpacked into snapshots; then a container of each image
runs under containerd's runc shim from that snapshot, printing its entry point's usage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kpx_cluster import images

pytestmark = [pytest.mark.netns]  # root: containerd mounts its snapshots

NAMESPACE = "k8s.io"  # the namespace kubelet's CRI (and so kind) uses
SNAPSHOTTER = "overlayfs"
IMPORT = ("images", "import", "--all-platforms", "--digests", f"--snapshotter={SNAPSHOTTER}", "-")

if not (shutil.which("containerd") and shutil.which("ctr")):
    pytest.skip(
        "containerd and ctr are not installed (Debian's containerd package; `make setup` "
        "installs it)",
        allow_module_level=True,
    )


def config(root: Path) -> str:
    """containerd's configuration: every path under `root`; CRI off (kind's node runs it, the
    import does not need it)."""
    return "\n".join(
        [
            "version = 2",
            f'root = "{root}/root"',
            f'state = "{root}/state"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
            "[grpc]",
            f'  address = "{root}/c.sock"',
            "[ttrpc]",
            f'  address = "{root}/c.sock.ttrpc"',
            "[debug]",
            '  address = ""',
            "[metrics]",
            '  address = ""',
            '[plugins."io.containerd.internal.v1.opt"]',
            f'  path = "{root}/opt"',
            "",
        ]
    )


@dataclass
class Containerd:
    socket: Path

    def ctr(self, *args: str, stdin: Path | None = None, timeout: float = 120) -> str:
        argv = ["ctr", f"--address={self.socket}", f"--namespace={NAMESPACE}", *args]
        with open(stdin, "rb") if stdin else open(os.devnull, "rb") as source:
            done = subprocess.run(
                argv, stdin=source, capture_output=True, text=True, timeout=timeout, check=False
            )
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr.strip()}"
        return done.stdout


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    # Short: a unix socket's path has 108 bytes at most.
    root = Path(tempfile.mkdtemp(prefix="kpx-ctrd-"))
    (root / "config.toml").write_text(config(root))
    log = open(root / "containerd.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        ["containerd", f"--config={root / 'config.toml'}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    daemon = Containerd(root / "c.sock")
    try:
        deadline = time.monotonic() + 30
        while True:
            ready = subprocess.run(
                ["ctr", f"--address={daemon.socket}", "version"],
                capture_output=True,
                check=False,
            )
            if ready.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"containerd did not start: {(root / 'containerd.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield daemon
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # Snapshots are mounted only while a container runs; whatever is left is unmounted.
        subprocess.run(["umount", "-R", str(root / "state")], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def manifest_digest(archive: Path) -> str:
    """The digest of the one image manifest the OCI archive's index names."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        index = json.load(member)
    (manifest,) = index["manifests"]
    return str(manifest["digest"])


@pytest.fixture(scope="module")
def imported(containerd: Containerd) -> dict[str, list[str]]:
    """Both archives imported as kind imports them; `ctr images ls` rows by reference."""
    directory = images.archives_dir()
    if images.missing(directory=directory):
        pytest.fail("the images are missing or stale: run `make image`", pytrace=False)
    for image in images.images(images.project_version()):
        containerd.ctr(*IMPORT, stdin=image.archive(directory), timeout=300)
    rows = [line.split() for line in containerd.ctr("images", "ls").splitlines()[1:]]
    return {row[0]: row for row in rows if row}


@pytest.mark.parametrize("image", images.images(images.project_version()), ids=lambda i: i.name)
def test_kind_imports_the_archive_under_the_repository_version(
    imported: dict[str, list[str]], image: images.Image
) -> None:
    assert image.ref in imported, f"{image.ref} not among {sorted(imported)}"
    ref, _type, digest = imported[image.ref][:3]
    assert digest == manifest_digest(image.archive(images.archives_dir()))
    # --digests also names the image by its digest, as kind's node then lists it.
    assert any(r.endswith(f"@{digest}") for r in imported if r != ref)


def test_the_imported_images_run_under_containerd(
    containerd: Containerd, imported: dict[str, list[str]], tmp_path: Path
) -> None:
    """Each image, unpacked into containerd's snapshotter, runs its entry point under runc
    (ctr's command replaces the image's whole entrypoint, so it is named)."""
    operator, agent = images.images(images.project_version())
    for image, command in ((agent, "proxy-agent"), (operator, "proxy-operator")):
        name = f"kpx-{image.target}-{os.getpid()}"
        out = containerd.ctr(
            "run", "--rm", f"--snapshotter={SNAPSHOTTER}", image.ref, name, command, "--help"
        )
        assert f"usage: {command}" in out, out
