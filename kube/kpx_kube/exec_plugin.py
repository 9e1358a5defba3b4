"""client.authentication.k8s.io exec credential plugins (v1 and v1beta1), as client-go runs them.

The plugin is run as an argument list (no shell) with the process's environment plus the
kubeconfig's `env`, and `KUBERNETES_EXEC_INFO` holding an ExecCredential whose spec says the
session is not interactive and, with `provideClusterInfo`, describes the cluster. Its stdout is
an ExecCredential of the same apiVersion whose status holds a bearer token or a client
certificate and key (PEM), and optionally an expirationTimestamp. Standard input is never given
(agents and operators have no terminal): a plugin whose interactiveMode is `Always` is refused.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from .kubeconfig import Cluster, ExecConfig, KubeconfigError

log = logging.getLogger(__name__)
KIND = "ExecCredential"
RUN_TIMEOUT = 60.0  # seconds a plugin may take (a cloud CLI can be slow on its first call)


class ExecPluginError(RuntimeError):
    """The plugin could not be run or its answer is unusable."""


@dataclass(frozen=True)
class ExecCredential:
    token: str | None = None
    cert: bytes | None = None  # PEM
    key: bytes | None = None  # PEM
    expires: datetime.datetime | None = None  # aware, UTC

    def expired(self, now: datetime.datetime) -> bool:
        return self.expires is not None and now >= self.expires


def exec_info(config: ExecConfig, cluster: Cluster, ca_pem: bytes | None) -> dict[str, Any]:
    """The ExecCredential given to the plugin in KUBERNETES_EXEC_INFO."""
    spec: dict[str, Any] = {"interactive": False}
    if config.provide_cluster_info:
        info: dict[str, Any] = {"server": cluster.server}
        if cluster.insecure_skip_tls_verify:
            info["insecure-skip-tls-verify"] = True
        if ca_pem:
            info["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
        if cluster.disable_compression:
            info["disable-compression"] = True
        if cluster.exec_config is not None:
            info["config"] = cluster.exec_config
        spec["cluster"] = info
    return {"apiVersion": config.api_version, "kind": KIND, "spec": spec}


def _timestamp(value: Any, where: str) -> datetime.datetime:
    try:
        stamp = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise ExecPluginError(f"{where}: not an RFC 3339 time: {value!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return stamp


def parse_credential(raw: bytes, config: ExecConfig) -> ExecCredential:
    """The plugin's stdout -> the credential, checked as client-go checks it."""
    where = f"{config.where} ({config.command})"
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ExecPluginError(f"{where}: stdout is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ExecPluginError(f"{where}: stdout is not an {KIND}")
    if doc.get("apiVersion") != config.api_version:
        raise ExecPluginError(
            f"{where}: the plugin answered apiVersion {doc.get('apiVersion')!r}"
            f", the kubeconfig asks for {config.api_version}"
        )
    status = doc.get("status")
    if not isinstance(status, dict):
        raise ExecPluginError(f"{where}: the {KIND} has no status")
    token = status.get("token") or None
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if not token and not cert and not key:
        raise ExecPluginError(f"{where}: status has no token and no clientCertificateData")
    if bool(cert) != bool(key):
        raise ExecPluginError(
            f"{where}: status has only one of clientCertificateData and clientKeyData"
        )
    expires = status.get("expirationTimestamp")
    return ExecCredential(
        token=str(token) if token else None,
        cert=str(cert).encode() if cert else None,
        key=str(key).encode() if key else None,
        expires=_timestamp(expires, f"{where}: status.expirationTimestamp") if expires else None,
    )


async def run(config: ExecConfig, cluster: Cluster, ca_pem: bytes | None) -> ExecCredential:
    """Run the plugin once (the I/O edge)."""
    if config.interactive_mode == "Always":
        raise KubeconfigError(
            f"{config.where}.interactiveMode: Always needs a terminal, and this process has none"
        )
    env = dict(os.environ)
    env.update(config.env)
    env["KUBERNETES_EXEC_INFO"] = json.dumps(exec_info(config, cluster, ca_pem))
    try:
        proc = await asyncio.create_subprocess_exec(
            config.command,
            *config.args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except (FileNotFoundError, PermissionError) as exc:
        hint = f"; {config.install_hint.strip()}" if config.install_hint else ""
        raise ExecPluginError(
            f"{config.where}.command: cannot run {config.command!r}: {exc.strerror}{hint}"
        ) from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ExecPluginError(
            f"{config.where}: {config.command} took more than {RUN_TIMEOUT:.0f} s"
        ) from None
    if err.strip():
        log.info("exec plugin %s: %s", config.command, err.decode(errors="replace").strip())
    if proc.returncode != 0:
        raise ExecPluginError(
            f"{config.where}: {config.command} exited with {proc.returncode}: "
            f"{err.decode(errors='replace').strip()[-500:]}"
        )
    return parse_credential(out, config)
