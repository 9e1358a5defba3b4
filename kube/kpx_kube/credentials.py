"""How a client reaches and authenticates to the apiserver: kubeconfig or in-cluster.

`Credentials.auth()` gives what one request uses (`Auth`: the SSL context and the bearer token):
- a static token or client certificate: the same every time;
- `tokenFile` and the in-cluster projected service-account token: the file is read again on
  every call (tokens rotate; the file is small and in the page cache);
- an `exec` plugin: its ExecCredential is cached until its expirationTimestamp and the plugin is
  run again after it, or after the apiserver answered 401 to it (`invalidate`), as client-go does.

Key material stays in memory (see `tls`): no file is written for `*-data` fields.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import exec_plugin, tls
from .kubeconfig import Cluster, ExecConfig, KubeconfigError, Material, parse

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The apiserver's own addresses (host:port, comma-separated), tried before
#: KUBERNETES_SERVICE_HOST: the kpx operator sets it on the agents from the `kubernetes`
#: Service's EndpointSlice, so an agent never needs a Service VIP (which only a proxy on the
#: node answers) to reach the apiserver.
APISERVER_ENDPOINTS_ENV = "KPX_APISERVER_ENDPOINTS"
#: How long a candidate address may take to accept a TCP connection at start.
PROBE_TIMEOUT = 1.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Auth:
    """What one request authenticates with."""

    ssl: ssl.SSLContext
    token: str | None = None
    expires: datetime.datetime | None = None  # when an exec credential runs out

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Credentials:
    def __init__(
        self,
        server: str,
        ssl_context: ssl.SSLContext,
        *,
        token: str | None = None,
        token_file: Path | None = None,
        exec_config: ExecConfig | None = None,
        cluster: Cluster | None = None,
        ca: bytes | None = None,
        insecure: bool = False,
        compression: bool = True,
        clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        self.server = server
        self.ssl_context = ssl_context  # the static one (an exec plugin may give its own)
        self.token = token
        self.token_file = token_file
        # The kubeconfig's `disable-compression` (as client-go): ask for uncompressed responses,
        # which on a fast network saves the apiserver's and the client's CPU on big lists.
        self.compression = compression
        self.exec_config = exec_config
        self.exec_runs = 0
        self._cluster = cluster or Cluster(server=server)
        self._ca = ca
        self._insecure = insecure
        self._clock = clock
        self._exec_auth: Auth | None = None
        self._exec_lock = asyncio.Lock()

    def _static(self) -> Auth:
        if self.token_file is not None:
            return Auth(self.ssl_context, self.token_file.read_text().strip() or None)
        return Auth(self.ssl_context, self.token)

    async def auth(self) -> Auth:
        """The credentials for the next request."""
        if self.exec_config is None:
            return self._static()
        async with self._exec_lock:
            cached = self._exec_auth
            if cached is not None and (cached.expires is None or self._clock() < cached.expires):
                return cached
            cred = await exec_plugin.run(self.exec_config, self._cluster, self._ca)
            self.exec_runs += 1
            ctx = self.ssl_context
            if cred.cert is not None and cred.key is not None:
                ctx = tls.ssl_context(
                    ca=self._ca, cert=cred.cert, key=cred.key, insecure=self._insecure
                )
            self._exec_auth = Auth(ctx, cred.token, cred.expires)
            return self._exec_auth

    def invalidate(self, used: Auth) -> None:
        """The apiserver answered 401 to `used`: the next `auth()` runs the plugin again
        (unless another request has already replaced that credential)."""
        if self._exec_auth is used:
            self._exec_auth = None


def _read(material: Material | None) -> bytes | None:
    if material is None:
        return None
    if material.data is not None:
        return material.data
    assert material.path is not None
    try:
        return material.path.read_bytes()
    except OSError as exc:
        raise KubeconfigError(
            f"{material.where}: cannot read {material.path}: {exc.strerror}"
        ) from None


def from_kubeconfig(path: Path, context: str | None = None) -> Credentials:
    """The credentials of `context` (default: the current context) of a kubeconfig file."""
    if os.pathsep in str(path):  # $KUBECONFIG may list files, which client-go merges
        raise KubeconfigError(
            f"{path}: several kubeconfig files; merging them is not supported: give one"
        )
    path = Path(path).expanduser()
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise KubeconfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"{path}: not YAML: {exc}") from None
    try:
        ctx = parse(doc, path.parent, context)
        cluster, user = ctx.cluster, ctx.user
        ca = _read(cluster.certificate_authority)
        cert, key = _read(user.client_certificate), _read(user.client_key)
        try:
            ssl_ctx = tls.ssl_context(
                ca=ca, cert=cert, key=key, insecure=cluster.insecure_skip_tls_verify
            )
        except ssl.SSLError as exc:
            raise KubeconfigError(
                f"context {ctx.name}: the certificate authority or the client key pair is "
                f"unusable: {exc}"
            ) from None
    except KubeconfigError as exc:
        raise KubeconfigError(f"{path}: {exc}") from None
    return Credentials(
        cluster.server,
        ssl_ctx,
        token=user.token,
        token_file=user.token_file,
        exec_config=user.exec,
        cluster=cluster,
        ca=ca,
        insecure=cluster.insecure_skip_tls_verify,
        compression=not cluster.disable_compression,
    )


def split_host_port(endpoint: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` -> (host, port); ValueError naming the entry otherwise."""
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{APISERVER_ENDPOINTS_ENV}: {endpoint!r} is not host:port")
    return host, int(port)


def apiserver_candidates(env: Mapping[str, str]) -> list[tuple[str, int]]:
    """Where to reach the apiserver, in order: the addresses in KPX_APISERVER_ENDPOINTS, then
    KUBERNETES_SERVICE_HOST/PORT (the `kubernetes` Service, as the kubelet sets it)."""
    out = [split_host_port(e) for e in env.get(APISERVER_ENDPOINTS_ENV, "").split(",") if e.strip()]
    host = env.get("KUBERNETES_SERVICE_HOST")
    if host:
        out.append((host.strip("[]"), int(env.get("KUBERNETES_SERVICE_PORT", "443"))))
    return list(dict.fromkeys(out))


def tcp_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT):
            return True
    except OSError:
        return False


def choose_endpoint(
    candidates: list[tuple[str, int]], reachable: Callable[[str, int], bool]
) -> tuple[str, int]:
    """The first candidate that accepts a connection; the first one when none does (the client
    then retries it as usual). One candidate is taken without a probe."""
    if len(candidates) > 1:
        for host, port in candidates:
            if reachable(host, port):
                return host, port
            log.warning("apiserver at %s:%d does not answer; trying the next address", host, port)
    return candidates[0]


def in_cluster(
    env: Mapping[str, str] = os.environ,
    reachable: Callable[[str, int], bool] = tcp_reachable,
) -> Credentials:
    """The pod's service account: the mounted CA and projected token (KPX_SERVICEACCOUNT_DIR:
    where they are mounted when not at the standard path), and the first apiserver address
    that answers of KPX_APISERVER_ENDPOINTS and KUBERNETES_SERVICE_HOST/PORT."""
    try:
        candidates = apiserver_candidates(env)
    except ValueError as exc:
        raise KubeconfigError(str(exc)) from None
    if not candidates:
        raise KubeconfigError("not in a cluster (no KUBERNETES_SERVICE_HOST): give a kubeconfig")
    host, port_number = choose_endpoint(candidates, reachable)
    port = str(port_number)
    if ":" in host:
        host = f"[{host}]"
    sa = Path(env.get("KPX_SERVICEACCOUNT_DIR", SA_DIR))
    ca = _read(Material(path=sa / "ca.crt", where="service account CA"))
    return Credentials(
        f"https://{host}:{port}", tls.ssl_context(ca=ca), token_file=sa / "token", ca=ca
    )
