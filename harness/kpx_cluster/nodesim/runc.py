"""The runc runtime of the node simulator: containers run from their images under runc.

`RuncRuntime` decides, per container image, how it runs:
- an image the `ImageStore` knows (what `make image` built, by name or by an extra tag given to
  `ImageStore.load`): under runc, from the image's root filesystem (unpacked once per digest,
  shared read-only; a container without readOnlyRootFilesystem gets an overlay of its own), with
  the pod's command/args over the image's entrypoint/cmd, its env over the image's, its volumes
  bind-mounted at their mountPaths, the node's network namespace (hostNetwork) or the pod's, and
  its securityContext enforced by runc (see `kpx_cluster.oci.runtime_spec`);
- an image among `host_images` (the harness's own test images, e.g. "python"): a host process,
  as the "process" runtime runs every container;
- any other image: not pullable (ErrImagePull, then ImagePullBackOff).

`RuncContainer` is one run of one container: `start` writes the bundle and starts ``runc run``
in the foreground (runc forwards signals to the container and exits with its status, so the
simulator's process supervision works unchanged); `cleanup` runs ``runc delete --force`` and
removes the bundle and the writable layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import images, oci
from ..netns import Topology
from . import netns

log = logging.getLogger(__name__)

#: Images the harness's e2e tests and demo give pods that run as host processes (no image
#: exists for them: their command is a host program).
HARNESS_IMAGES = frozenset({"python", "echo", "web", "kpx/http-backend", "kpx-demo/http-backend"})


class ImagePullError(RuntimeError):
    """The image cannot be had (ErrImagePull)."""


def container_id(pod: str, uid: str, container: str, attempt: int) -> str:
    """A runc container id (letters, digits, ``-_.``), unique per pod uid, container, run."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{pod}_{container}")[:60]
    return f"{stem}_{uid[:8]}_{attempt}"


def read_only_volume(volume: Mapping[str, Any]) -> bool:
    """Whether the kubelet mounts this volume read-only whatever the mount says (API-backed
    volumes: configMap, secret, projected, downwardAPI)."""
    return any(k in volume for k in ("configMap", "secret", "projected", "downwardAPI"))


def mounts(
    pod_spec: Mapping[str, Any], container: Mapping[str, Any], dirs: Mapping[str, Path]
) -> list[oci.Mount]:
    """The container's volumeMounts as bind mounts of the directories backing the volumes."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    out = []
    for mount in container.get("volumeMounts") or []:
        real = dirs.get(mount["name"])
        if real is None:
            continue
        source = real / mount["subPath"] if mount.get("subPath") else real
        read_only = bool(mount.get("readOnly")) or read_only_volume(volumes.get(mount["name"], {}))
        out.append(oci.Mount(str(source), str(mount["mountPath"]), read_only))
    return out


_unpack_lock = threading.Lock()


def built_images() -> oci.ImageStore:
    """The store of the images `make image` built (operator and agent, this version, and
    upstream kube-proxy's when built: `images.build_kube_proxy`); a
    RuntimeError naming `make image` when they are missing or stale. $KPX_IMAGES_DIR, when
    set, names another directory of archives (`images.build_all(directory=...)` writes one:
    several work trees on one machine then do not rebuild each other's images)."""
    override = os.environ.get("KPX_IMAGES_DIR")
    directory = Path(override) if override else images.images_dir()
    if images.missing(directory=directory):
        raise RuntimeError("the images are missing or stale: run `make image`")
    store = oci.ImageStore(directory / "rootfs")
    for image in images.images(images.project_version()):
        store.load(image.archive(directory))
    if not images.kube_proxy_missing(directory=directory):  # for the migration tests
        store.load(images.kube_proxy_image().archive(directory))
    return store


@dataclass
class RuncRuntime:
    """Runs containers from the images of `store` under runc; bundles under `state_dir`."""

    store: oci.ImageStore
    state_dir: Path
    host_images: Collection[str] = HARNESS_IMAGES

    def decide(self, image: str) -> Literal["runc", "process"]:
        """How a container with `image` runs; ImagePullError when it cannot."""
        if image in self.store.refs:
            return "runc"
        if image in self.host_images:
            return "process"
        raise ImagePullError(
            f'image "{image}" is not among the built images ({", ".join(sorted(self.store.refs))})'
        )

    def unpack(self, image: str) -> oci.Unpacked:
        """The image's root filesystem (blocking; the first use of a digest unpacks it)."""
        with _unpack_lock:
            try:
                return self.store.unpack(image)
            except (KeyError, OSError, subprocess.CalledProcessError, ValueError) as err:
                raise ImagePullError(f'image "{image}" cannot be unpacked: {err}') from err


class RuncContainer:
    """One run of one container under runc (start, then cleanup once it has exited)."""

    def __init__(self, runtime: RuncRuntime, cid: str) -> None:
        self.runtime = runtime
        self.id = cid
        self.bundle = oci.Bundle(runtime.state_dir / cid)
        self._layer: contextlib.ExitStack | None = None

    def start(
        self,
        topology: Topology,
        image: oci.Unpacked,
        argv: Sequence[str],
        env: Mapping[str, str],
        sc: oci.SecurityContext,
        *,
        netns_name: str,
        volume_mounts: Sequence[oci.Mount],
        hostname: str,
        cwd: str | None,
        log_file: Path,
    ) -> subprocess.Popen[Any]:
        """Write the bundle and start ``runc run`` (blocking call). oci.SecurityError when the
        securityContext cannot be honoured (CreateContainerConfigError)."""
        spec = oci.runtime_spec(
            image.rootfs,
            argv,
            env,
            image.config,
            sc,
            netns=netns.path(netns_name),
            mounts=volume_mounts,
            hostname=hostname,
            cwd=cwd,
            bounding=oci.own_bounding_set(),
        )
        shutil.rmtree(self.bundle.path, ignore_errors=True)
        self.bundle.path.mkdir(parents=True)
        if not spec["root"]["readonly"]:
            self._layer = contextlib.ExitStack()
            merged = self._layer.enter_context(
                oci.writable_root(image.rootfs, self.bundle.path / "layer")
            )
            spec["root"] = {**spec["root"], "path": str(merged)}
        self.bundle.spec = spec
        self.bundle.write()
        argv_runc = ["runc", "run", "--bundle", str(self.bundle.path), self.id]
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("ab") as out:
            return topology.run_host(
                argv_runc, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

    def exec_argv(self, command: Sequence[str]) -> list[str]:
        """argv running `command` inside the container (exec probes)."""
        return ["runc", "exec", self.id, *command]

    def kill_now(self) -> None:
        subprocess.run(["runc", "kill", self.id, "KILL"], capture_output=True, check=False)

    def cleanup(self) -> None:
        """``runc delete --force`` (kills what is left), then drop the layer and the bundle
        (blocking call; idempotent)."""
        subprocess.run(["runc", "delete", "--force", self.id], capture_output=True, check=False)
        if self._layer is not None:
            self._layer.close()
            self._layer = None
        shutil.rmtree(self.bundle.path, ignore_errors=True)
