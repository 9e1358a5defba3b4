"""Pod volumes of the node simulator: the per-pod directories a kubelet would mount.

There are no mounts: each volume is a directory under the pod's directory (hostPath volumes a
directory under the node's, but for the per-network-namespace sysctls of PER_NETNS_HOST_PATHS),
and container paths are mapped onto them (see nodesim.env).
configMap, secret, downwardAPI and projected volumes are written like the kubelet's
AtomicWriter does: the files live in a timestamped directory that the ``..data`` symlink points
to, user-visible names are symlinks through ``..data``, and an update swaps ``..data`` with one
rename, so readers never see a half-written volume. They are re-synced every couple of seconds
and rewritten only when their content changed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Final

from .api import ApiError, KubeApi, Obj

log = logging.getLogger(__name__)

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where the ServiceAccount admission plugin mounts the kube-api-access volume."""

Payload = dict[str, tuple[bytes, int]]
"""Relative file path -> (content, mode)."""

DEFAULT_MODE = 0o644


#: hostPaths whose content is per network namespace, given as the real path: the node's
#: netfilter sysctls (conntrack timeouts; nf_conntrack_max is read-only outside the host's
#: namespace) and net.ipv4 sysctls (ipvs mode's vs.conntrack and co.), as a hostNetwork pod on
#: a kind node sees them. Writing them changes only the writer's namespace.
PER_NETNS_HOST_PATHS: Final = frozenset({"/proc/sys/net/netfilter", "/proc/sys/net/ipv4"})
#: hostPaths of host-global state (the nf_conntrack module's parameters): a per-node stand-in
#: holding a copy of these files of the host, so a pod reads the host's values but never
#: writes them.
COPIED_HOST_FILES: Final[dict[str, tuple[str, ...]]] = {
    "/sys/module/nf_conntrack/parameters": ("hashsize",),
}


class VolumeError(RuntimeError):
    """A volume cannot be set up yet (a missing ConfigMap/Secret/key, a refused request)."""


class ObjectCache:
    """ConfigMaps and Secrets read with the node's credentials, each at most once per `ttl`."""

    def __init__(self, api: KubeApi, ttl: float = 1.5) -> None:
        self.api = api
        self.ttl = ttl
        self._entries: dict[tuple[str, str, str], tuple[float, Obj | None]] = {}
        self._inflight: dict[tuple[str, str, str], asyncio.Future[Obj | None]] = {}

    async def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        """The object (None if it does not exist); ApiError if the apiserver refuses."""
        key = (resource, namespace, name)
        entry = self._entries.get(key)
        if entry is not None and time.monotonic() - entry[0] < self.ttl:
            return entry[1]
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        fut: asyncio.Future[Obj | None] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            obj = await self.api.get_or_none(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
        except BaseException as err:
            fut.set_exception(err)
            fut.exception()  # retrieved: the callers waiting on it get it raised
            raise
        finally:
            del self._inflight[key]
        self._entries[key] = (time.monotonic(), obj)
        fut.set_result(obj)
        return obj


class TokenCache:
    """Bound ServiceAccount tokens (TokenRequest), refreshed at 80% of their lifetime."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api
        self._tokens: dict[tuple[str, ...], tuple[float, float, str]] = {}

    async def get(self, pod: Obj, audience: str | None, expiration: int) -> str:
        """A token for the pod's ServiceAccount, bound to the pod."""
        meta, spec = pod["metadata"], pod["spec"]
        namespace, sa = meta["namespace"], spec.get("serviceAccountName") or "default"
        key = (namespace, sa, audience or "", str(expiration), meta["uid"])
        cached = self._tokens.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < 0.8 * cached[1]:
            return cached[2]
        body: Obj = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": expiration,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        if audience:
            body["spec"]["audiences"] = [audience]
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token"
        answer = await self.api.request("POST", path, body=body)
        token = str(answer["status"]["token"])
        self._tokens[key] = (now, float(expiration), token)
        return token

    def forget(self, pod_uid: str) -> None:
        for key in [k for k in self._tokens if k[-1] == pod_uid]:
            del self._tokens[key]


def field_value(pod: Obj, field_path: str) -> str | None:
    """A downward-API field of `pod` (fieldRef.fieldPath); None if not supported."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
    }
    if field_path in simple:
        return str(simple[field_path] or "")
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        values: Mapping[str, str] = meta.get(source) or {}
        if field_path == prefix:
            return "".join(f'{k}="{v}"\n' for k, v in sorted(values.items()))
        if field_path.startswith(prefix + "['") and field_path.endswith("']"):
            return values.get(field_path[len(prefix) + 2 : -2], "")
    return None


def _key_files(
    data: Mapping[str, bytes],
    items: list[Obj] | None,
    mode: int,
    optional: bool,
    what: str,
) -> Payload:
    """The files of a configMap/secret source: all keys, or the listed `items`."""
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    files: Payload = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"{what} has no key {item['key']!r}")
        files[item["path"]] = (data[item["key"]], int(item.get("mode", mode)))
    return files


def config_map_data(cm: Obj) -> dict[str, bytes]:
    """A ConfigMap's data and binaryData as bytes."""
    data = {k: str(v).encode() for k, v in (cm.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return data


def secret_data(secret: Obj) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


class AtomicDir:
    """A directory whose whole content is replaced atomically, kubelet AtomicWriter style."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._current: Payload | None = None

    def write(self, payload: Payload) -> bool:
        """Make the directory hold exactly `payload`; False (and no I/O) if it already does."""
        if payload == self._current:
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y_%m_%d_%H_%M_%S") + "." + secrets.token_hex(4)
        version = self.path / f"..{stamp}"
        version.mkdir(mode=0o755)
        for rel, (content, mode) in payload.items():
            target = version / PurePosixPath(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            target.chmod(mode & 0o777)
        data_link = self.path / "..data"
        old = os.readlink(data_link) if data_link.is_symlink() else None
        tmp_link = self.path / "..data_tmp"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(version.name)
        tmp_link.replace(data_link)  # the atomic switch
        new_top = {PurePosixPath(rel).parts[0] for rel in payload}
        old_top = {PurePosixPath(rel).parts[0] for rel in self._current or {}}
        for name in new_top - old_top:
            link = self.path / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
        for name in old_top - new_top:
            (self.path / name).unlink(missing_ok=True)
        if old is not None:
            shutil.rmtree(self.path / old, ignore_errors=True)
        self._current = dict(payload)
        return True


class PodVolumes:
    """The directories of one pod's volumes; `sync` (re)writes the API-backed ones."""

    def __init__(
        self,
        pod: Obj,
        pod_dir: Path,
        node_dir: Path,
        objects: ObjectCache,
        tokens: TokenCache,
    ) -> None:
        self.pod = pod
        self.root = pod_dir / "volumes"
        self.node_dir = node_dir
        self.objects = objects
        self.tokens = tokens
        self.dirs: dict[str, Path] = {}
        self._writers: dict[str, AtomicDir] = {}
        self._prepared = False

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    def _prepare(self) -> None:
        """Create the plain directories (emptyDir, hostPath, unsupported types) once."""
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                self.dirs[name] = self._host_path(vol["hostPath"])
                continue
            path = self.root / name
            self.dirs[name] = path
            if any(k in vol for k in ("configMap", "secret", "projected", "downwardAPI")):
                self._writers[name] = AtomicDir(path)
                continue
            if "emptyDir" not in vol:
                log.warning(
                    "volume %s of %s: type not simulated, an empty directory",
                    name,
                    self.pod["metadata"]["name"],
                )
            path.mkdir(parents=True, exist_ok=True)
        self._prepared = True

    def _host_path(self, source: Obj) -> Path:
        """The per-node stand-in for a hostPath (never the real host path), but for the
        per-network-namespace sysctl directories of PER_NETNS_HOST_PATHS, which are the real
        path (a process reading it sees its own namespace's: a hostNetwork pod the node's)."""
        absolute = os.path.normpath("/" + str(source["path"]).lstrip("/"))  # no escaping via ..
        if absolute in PER_NETNS_HOST_PATHS and Path(absolute).is_dir():
            return Path(absolute)
        rel = absolute.lstrip("/")
        mapped = self.node_dir / "hostpath" / rel
        copied = COPIED_HOST_FILES.get(absolute)
        if copied is not None and not mapped.exists():
            mapped.mkdir(parents=True, exist_ok=True)
            for name in copied:
                with contextlib.suppress(OSError):  # the module is not loaded: nothing to copy
                    (mapped / name).write_text((Path(absolute) / name).read_text())
        kind = source.get("type") or ""
        if kind in ("File", "FileOrCreate"):
            mapped.parent.mkdir(parents=True, exist_ok=True)
            mapped.touch(exist_ok=True)
        elif kind in ("", "Directory", "DirectoryOrCreate"):
            mapped.mkdir(parents=True, exist_ok=True)
        else:  # Socket, CharDevice, BlockDevice: the parent must exist
            mapped.parent.mkdir(parents=True, exist_ok=True)
        return mapped

    async def sync(self) -> bool:
        """Write every API-backed volume whose content changed; True if any did."""
        if not self._prepared:
            self._prepare()
        changed = False
        for vol in self.pod["spec"].get("volumes") or []:
            writer = self._writers.get(vol["name"])
            if writer is not None:
                payload = await self._payload(vol)
                changed = writer.write(payload) or changed
        return changed

    async def _payload(self, vol: Obj) -> Payload:
        if "configMap" in vol:
            return await self._config_map(vol["configMap"], None)
        if "secret" in vol:
            return await self._secret(vol["secret"], None)
        if "downwardAPI" in vol:
            return self._downward(vol["downwardAPI"], None)
        projected = vol["projected"]
        mode = int(projected.get("defaultMode", DEFAULT_MODE))
        files: Payload = {}
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                files.update(await self._token(source["serviceAccountToken"], mode))
            elif "configMap" in source:
                files.update(await self._config_map(source["configMap"], mode))
            elif "secret" in source:
                files.update(await self._secret(source["secret"], mode))
            elif "downwardAPI" in source:
                files.update(self._downward(source["downwardAPI"], mode))
            else:
                log.warning("projected source %s is not simulated", sorted(source))
        return files

    async def _fetch(self, resource: str, name: str) -> Obj | None:
        try:
            return await self.objects.get(resource, self.namespace, name)
        except ApiError as err:
            raise VolumeError(f"reading {resource} {self.namespace}/{name}: {err}") from err

    async def _config_map(self, source: Obj, mode: int | None) -> Payload:
        mode = int(source.get("defaultMode", mode if mode is not None else DEFAULT_MODE))
        optional = bool(source.get("optional"))
        cm = await self._fetch("configmaps", source["name"])
        if cm is None:
            if optional:
                return {}
            raise VolumeError(f"configmap {self.namespace}/{source['name']} not found")
        what = f"configmap {self.namespace}/{source['name']}"
        return _key_files(config_map_data(cm), source.get("items"), mode, optional, what)

    async def _secret(self, source: Obj, mode: int | None) -> Payload:
        mode = int(source.get("defaultMode", mode if mode is not None else DEFAULT_MODE))
        name = source.get("secretName") or source["name"]
        optional = bool(source.get("optional"))
        secret = await self._fetch("secrets", name)
        if secret is None:
            if optional:
                return {}
            raise VolumeError(f"secret {self.namespace}/{name} not found")
        what = f"secret {self.namespace}/{name}"
        return _key_files(secret_data(secret), source.get("items"), mode, optional, what)

    def _downward(self, source: Obj, mode: int | None) -> Payload:
        mode = int(source.get("defaultMode", mode if mode is not None else DEFAULT_MODE))
        files: Payload = {}
        for item in source.get("items") or []:
            ref = item.get("fieldRef")
            value = field_value(self.pod, ref["fieldPath"]) if ref else None
            if value is None:
                log.warning("downwardAPI item %s is not simulated", item)
                value = ""
            files[item["path"]] = (value.encode(), int(item.get("mode", mode)))
        return files

    async def _token(self, source: Obj, mode: int) -> Payload:
        try:
            token = await self.tokens.get(
                self.pod, source.get("audience"), int(source.get("expirationSeconds", 3600))
            )
        except ApiError as err:
            raise VolumeError(f"TokenRequest: {err}") from err
        return {source["path"]: (token.encode(), mode)}

    def remove(self) -> None:
        """Delete the pod's volume directories (hostPath directories stay: they are the node's)."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.tokens.forget(str(self.pod["metadata"]["uid"]))
