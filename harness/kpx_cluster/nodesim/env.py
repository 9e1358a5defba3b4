"""A container's argv and environment in the node simulator, the way a kubelet builds them.

Kubernetes semantics kept: ``$(VAR)`` references in command, args and env values expand to
earlier variables (``$$`` escapes a dollar, unknown references stay as written); envFrom comes
first, env entries override it; valueFrom supports fieldRef, configMapKeyRef, secretKeyRef and
resourceFieldRef (limits, else the node's allocatable). Simulator specifics: each volumeMount's
mountPath, wherever it appears as a path in command, args or an env value, is rewritten to the
real directory backing it (there are no mounts), and when the ServiceAccount volume is mounted,
KPX_SERVICEACCOUNT_DIR names its directory.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .api import ApiError, Obj
from .volumes import SA_MOUNT, ObjectCache, config_map_data, field_value, secret_data

PASSTHROUGH_ENV = ("HOME", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV")
"""Variables taken from the simulator's own environment (plus PATH) for every container."""

NODE_ALLOCATABLE = {"cpu": "4", "memory": str(8 * 2**30), "ephemeral-storage": str(100 * 2**30)}


class ConfigError(RuntimeError):
    """The container's configuration cannot be built (CreateContainerConfigError)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion of `text` against `env`."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "$" and i + 1 < n:
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


class PathMap:
    """Container paths (volume mountPaths) -> the simulator's real directories."""

    def __init__(self, mounts: Sequence[tuple[str, Path]]) -> None:
        self.mounts = sorted(
            ((mp.rstrip("/") or "/", real) for mp, real in mounts), key=lambda m: -len(m[0])
        )
        self._real = dict(self.mounts)
        alternatives = "|".join(re.escape(mp) for mp, _ in self.mounts if mp != "/")
        # A mount path counts where it is a whole path prefix: not glued to a longer name.
        self._pattern = (
            re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])") if alternatives else None
        )

    def rewrite(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: str(self._real[m.group(1)]), text)

    def real(self, container_path: str) -> Path | None:
        """The real directory for `container_path` (exactly a mount path), if mounted."""
        return self._real.get(container_path.rstrip("/") or "/")


def base_env(apiserver_port: int) -> dict[str, str]:
    """What every container starts with: PATH (this Python's bin directory first) and co."""
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    bindir = str(Path(sys.executable).parent)
    if path.split(os.pathsep)[0] != bindir:
        path = os.pathsep.join([bindir, path])
    env = {"PATH": path}
    env.update({k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ})
    env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
    env["KUBERNETES_SERVICE_PORT"] = str(apiserver_port)
    env["KUBERNETES_SERVICE_PORT_HTTPS"] = str(apiserver_port)
    return env


class EnvBuilder:
    """Builds the environment, argv and working directory of one container of one pod."""

    def __init__(self, pod: Obj, objects: ObjectCache, paths: PathMap) -> None:
        self.pod = pod
        self.objects = objects
        self.paths = paths

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    async def _data(self, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
        resource = "configmaps" if kind == "configmap" else "secrets"
        try:
            obj = await self.objects.get(resource, self.namespace, name)
        except ApiError as err:
            raise ConfigError(f"reading {kind} {self.namespace}/{name}: {err}") from err
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{kind} "{name}" not found')
        return config_map_data(obj) if kind == "configmap" else secret_data(obj)

    async def env(self, container: Obj, base: Mapping[str, str]) -> dict[str, str]:
        """The container's environment on top of `base`."""
        env = dict(base)
        env["HOSTNAME"] = (
            self.pod["spec"]["nodeName"]
            if self.pod["spec"].get("hostNetwork")
            else self.pod["metadata"]["name"]
        )
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for key in ("configMapRef", "secretRef"):
                if key in source:
                    ref = source[key]
                    kind = "configmap" if key == "configMapRef" else "secret"
                    data = await self._data(kind, ref["name"], bool(ref.get("optional")))
                    env.update({prefix + k: v.decode() for k, v in (data or {}).items()})
        for var in container.get("env") or []:
            value = await self._value(var, container, env)
            if value is not None:
                env[var["name"]] = self.paths.rewrite(value)
        sa_dir = self.paths.real(SA_MOUNT)
        if sa_dir is not None:
            env["KPX_SERVICEACCOUNT_DIR"] = str(sa_dir)
        return env

    async def _value(self, var: Obj, container: Obj, env: Mapping[str, str]) -> str | None:
        if "valueFrom" not in var:
            return expand(str(var.get("value", "")), env)
        source = var["valueFrom"]
        if "fieldRef" in source:
            value = field_value(self.pod, source["fieldRef"]["fieldPath"])
            if value is None:
                raise ConfigError(f"fieldRef {source['fieldRef']['fieldPath']} not supported")
            return value
        for key, kind in (("configMapKeyRef", "configmap"), ("secretKeyRef", "secret")):
            if key in source:
                ref = source[key]
                optional = bool(ref.get("optional"))
                data = await self._data(kind, ref["name"], optional)
                if data is None or ref["key"] not in data:
                    if optional:
                        return None
                    raise ConfigError(f'{kind} "{ref["name"]}" has no key "{ref["key"]}"')
                return data[ref["key"]].decode()
        if "resourceFieldRef" in source:
            resource = str(source["resourceFieldRef"]["resource"])
            group, _, name = resource.partition(".")
            declared = (container.get("resources") or {}).get(group) or {}
            return str(declared.get(name) or NODE_ALLOCATABLE.get(name, "0"))
        raise ConfigError(f"env {var['name']}: valueFrom {sorted(source)} not supported")

    def argv(self, container: Obj, env: Mapping[str, str]) -> list[str]:
        """command + args, expanded and with mount paths rewritten; ConfigError if empty."""
        words = [*(container.get("command") or []), *(container.get("args") or [])]
        if not container.get("command"):
            raise ConfigError(
                "no command: the node simulator has no images, so every container needs one"
            )
        return [self.paths.rewrite(expand(str(w), env)) for w in words]

    def workdir(self, container: Obj, default: Path) -> Path:
        """workingDir mapped onto the real directories, else `default`."""
        wd = container.get("workingDir")
        if not wd:
            return default
        mapped = Path(self.paths.rewrite(str(wd)))
        return mapped if mapped.is_dir() else default
