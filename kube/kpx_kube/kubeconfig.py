"""A kubeconfig document -> the cluster and user of one context. Pure: no file is read here.

Paths in the document (certificate-authority, client-certificate, client-key, tokenFile, and an
exec command that contains a `/`) are `~`-expanded and resolved against the kubeconfig's folder,
as client-go resolves them. Every error names the field it is about, e.g.
`users[alice].user.client-key-data: not base64`.

Fields that change how a client connects or authenticates and that this client does not
implement (proxy-url, tls-server-name, auth-provider, username/password, impersonation) are
refused, never silently ignored.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_EXTENSION = "client.authentication.k8s.io/exec"  # a cluster extension passed to plugins
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")


class KubeconfigError(ValueError):
    """A kubeconfig this client cannot use; the message names the field."""


@dataclass(frozen=True)
class Material:
    """PEM bytes given inline (`*-data`) or a file to read them from."""

    data: bytes | None = None
    path: Path | None = None
    where: str = ""  # the field path, for messages


@dataclass(frozen=True)
class ExecConfig:
    """A user's `exec` credential plugin (run as an argument list, never through a shell)."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = EXEC_API_VERSIONS[0]
    install_hint: str = ""
    provide_cluster_info: bool = False
    interactive_mode: str = "IfAvailable"
    where: str = "exec"  # the field path, for messages


@dataclass(frozen=True)
class Cluster:
    server: str
    certificate_authority: Material | None = None
    insecure_skip_tls_verify: bool = False
    disable_compression: bool = False
    exec_config: Any = None  # extensions[client.authentication.k8s.io/exec], for plugins


@dataclass(frozen=True)
class User:
    client_certificate: Material | None = None
    client_key: Material | None = None
    token: str | None = None
    token_file: Path | None = None
    exec: ExecConfig | None = None


@dataclass(frozen=True)
class Context:
    name: str
    cluster: Cluster
    user: User = field(default_factory=User)


UNSUPPORTED_CLUSTER = ("proxy-url", "tls-server-name")
UNSUPPORTED_USER = (
    "auth-provider",
    "username",
    "password",
    "as",
    "as-uid",
    "as-groups",
    "as-user-extra",
)


def _path(value: Any, base_dir: Path, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise KubeconfigError(f"{where}: a path is needed, got {value!r}")
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def _material(entry: Mapping[str, Any], key: str, base_dir: Path, where: str) -> Material | None:
    data, path = entry.get(f"{key}-data"), entry.get(key)
    if data and path:
        raise KubeconfigError(f"{where}: {key} and {key}-data are both set; give one")
    if data:
        try:
            return Material(data=base64.b64decode(str(data), validate=True))
        except (binascii.Error, ValueError):
            raise KubeconfigError(f"{where}.{key}-data: not base64") from None
    if path:
        return Material(path=_path(path, base_dir, f"{where}.{key}"), where=f"{where}.{key}")
    return None


def _named(doc: Mapping[str, Any], section: str, inner: str) -> dict[str, Mapping[str, Any]]:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise KubeconfigError(f"{section}: a list is needed")
    out: dict[str, Mapping[str, Any]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not entry.get("name"):
            raise KubeconfigError(f"{section}[{i}].name: missing")
        if not isinstance(entry["name"], str):
            raise KubeconfigError(f"{section}[{i}].name: a string is needed")
        body = entry.get(inner) or {}
        if not isinstance(body, Mapping):
            raise KubeconfigError(f"{section}[{entry['name']}].{inner}: a mapping is needed")
        out[str(entry["name"])] = body
    return out


def _refuse(entry: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if entry.get(key):
            raise KubeconfigError(f"{where}.{key}: not supported by this client")


def _exec(raw: Any, base_dir: Path, where: str) -> ExecConfig:
    if not isinstance(raw, Mapping):
        raise KubeconfigError(f"{where}: a mapping is needed")
    command = raw.get("command")
    if not isinstance(command, str) or not command:
        raise KubeconfigError(f"{where}.command: missing")
    if "/" in command:  # a path, not a name looked up in PATH: resolve it as client-go does
        command = str(_path(command, base_dir, f"{where}.command"))
    api_version = raw.get("apiVersion")
    if api_version not in EXEC_API_VERSIONS:
        raise KubeconfigError(
            f"{where}.apiVersion: {api_version!r} is not one of {', '.join(EXEC_API_VERSIONS)}"
        )
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise KubeconfigError(f"{where}.args: a list of strings is needed")
    env: list[tuple[str, str]] = []
    for i, var in enumerate(raw.get("env") or []):
        if not isinstance(var, Mapping) or not var.get("name"):
            raise KubeconfigError(f"{where}.env[{i}].name: missing")
        env.append((str(var["name"]), str(var.get("value") or "")))
    mode = raw.get("interactiveMode")
    if mode is None:
        if api_version.endswith("/v1"):
            raise KubeconfigError(f"{where}.interactiveMode: required by {api_version}")
        mode = "IfAvailable"
    if mode not in INTERACTIVE_MODES:
        raise KubeconfigError(
            f"{where}.interactiveMode: {mode!r} is not one of {', '.join(INTERACTIVE_MODES)}"
        )
    return ExecConfig(
        command=command,
        args=tuple(args),
        env=tuple(env),
        api_version=api_version,
        install_hint=str(raw.get("installHint") or ""),
        provide_cluster_info=bool(raw.get("provideClusterInfo")),
        interactive_mode=mode,
        where=where,
    )


def parse(doc: Any, base_dir: Path, context: str | None = None) -> Context:
    """The cluster and user of `context` (default: current-context) of a kubeconfig."""
    if not isinstance(doc, Mapping):
        raise KubeconfigError("not a kubeconfig (a mapping is needed)")
    contexts = _named(doc, "contexts", "context")
    name = context or doc.get("current-context")
    if not name:
        raise KubeconfigError("current-context: not set (and no context was asked for)")
    if not isinstance(name, str):
        raise KubeconfigError(f"current-context: a context name is needed, got {name!r}")
    if name not in contexts:
        what = "context" if context else "current-context"
        raise KubeconfigError(f"{what}: no context named {name!r} in contexts")
    ctx = contexts[name]
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    clusters = _named(doc, "clusters", "cluster")
    if not isinstance(cluster_name, str) or cluster_name not in clusters:
        raise KubeconfigError(
            f"contexts[{name}].context.cluster: no cluster named {cluster_name!r} in clusters"
        )
    users = _named(doc, "users", "user")
    if user_name and (not isinstance(user_name, str) or user_name not in users):
        raise KubeconfigError(
            f"contexts[{name}].context.user: no user named {user_name!r} in users"
        )
    return Context(
        name=str(name),
        cluster=_cluster(clusters[cluster_name], base_dir, f"clusters[{cluster_name}].cluster"),
        user=_user(users[user_name], base_dir, f"users[{user_name}].user") if user_name else User(),
    )


def _cluster(raw: Mapping[str, Any], base_dir: Path, where: str) -> Cluster:
    _refuse(raw, UNSUPPORTED_CLUSTER, where)
    server = raw.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigError(f"{where}.server: an http(s) URL is needed, got {server!r}")
    extensions = _named(raw, "extensions", "extension")
    return Cluster(
        server=server.rstrip("/"),
        certificate_authority=_material(raw, "certificate-authority", base_dir, where),
        insecure_skip_tls_verify=bool(raw.get("insecure-skip-tls-verify")),
        disable_compression=bool(raw.get("disable-compression")),
        exec_config=extensions.get(EXEC_EXTENSION),
    )


def _user(raw: Mapping[str, Any], base_dir: Path, where: str) -> User:
    _refuse(raw, UNSUPPORTED_USER, where)
    cert = _material(raw, "client-certificate", base_dir, where)
    key = _material(raw, "client-key", base_dir, where)
    if (cert is None) != (key is None):
        missing = "client-key" if key is None else "client-certificate"
        raise KubeconfigError(f"{where}.{missing}: needed with the other half of the key pair")
    exec_raw = raw.get("exec")
    token, token_file = raw.get("token"), raw.get("tokenFile")
    if exec_raw and (token or token_file):
        raise KubeconfigError(f"{where}: exec and token/tokenFile are both set; give one")
    return User(
        client_certificate=cert,
        client_key=key,
        token=str(token) if token else None,
        token_file=_path(token_file, base_dir, f"{where}.tokenFile") if token_file else None,
        exec=_exec(exec_raw, base_dir, f"{where}.exec") if exec_raw else None,
    )
