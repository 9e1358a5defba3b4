"""Credentials against a real apiserver: the agent's client, the operator's ApiServer and the
operator's kopf login authenticate through an exec credential plugin (re-run after its
credential expires and after a 401), and a kubeconfig with client-key-data leaves no file with
the key behind.

The plugin is a small script that prints an ExecCredential holding a ServiceAccount token from
the apiserver's TokenRequest API (`kubectl create token`), and counts its runs in a file.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import kopf
import pytest
import yaml

from kpx_cluster.controlplane import Cluster
from kpx_cluster.leaks import files_holding
from kpx_kube import ApiError, from_kubeconfig
from kpx_kube import Client as KubeClient
from kpx_operator.apiserver import ApiError as OperatorApiError
from kpx_operator.apiserver import ApiServer
from kpx_operator.cli import operator_settings
from kpx_operator.handlers import login_handler

pytestmark = pytest.mark.e2e

SA = "kpx-exec-plugin-test"
NS = "default"
SERVICES = "/api/v1/namespaces/default/services"

PLUGIN = """#!{python}
import datetime, json, os, sys
runs = os.environ["RUNS_FILE"]
n = int(open(runs).read()) + 1 if os.path.exists(runs) else 1
open(runs, "w").write(str(n))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
open(os.environ["INFO_FILE"], "w").write(json.dumps(info))
token = open(os.environ["TOKEN_FILE"]).read().strip()
if n == 1 and os.environ.get("FIRST_TOKEN_BAD"):
    token = "not-a-token"
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
    seconds=float(os.environ["LIFETIME"]))
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": {{
    "token": token, "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}))
"""


@pytest.fixture(scope="module")
def sa_token(cluster: Cluster) -> Iterator[str]:
    """A token of a ServiceAccount that may read Services (TokenRequest API)."""
    cluster.kubectl("-n", NS, "create", "serviceaccount", SA)
    cluster.kubectl(
        "create", "clusterrole", SA, "--verb=get,list,watch", "--resource=services,configmaps"
    )
    cluster.kubectl(
        "create", "clusterrolebinding", SA, f"--clusterrole={SA}", f"--serviceaccount={NS}:{SA}"
    )
    try:
        yield cluster.kubectl("-n", NS, "create", "token", SA, "--duration=20m").stdout.strip()
    finally:
        cluster.kubectl(
            "delete", "clusterrolebinding,clusterrole", SA, "--ignore-not-found", check=False
        )
        cluster.kubectl("-n", NS, "delete", "serviceaccount", SA, "--ignore-not-found", check=False)


@dataclass
class Plugin:
    kubeconfig: Path
    runs_file: Path
    info_file: Path

    @property
    def runs(self) -> int:
        return int(self.runs_file.read_text()) if self.runs_file.exists() else 0

    @property
    def info(self) -> dict[str, object]:
        return dict(json.loads(self.info_file.read_text()))


def plugin_kubeconfig(
    cluster: Cluster, tmp_path: Path, token: str, lifetime: float, first_token_bad: bool = False
) -> Plugin:
    """A kubeconfig whose user is the exec plugin (v1, relative command, provideClusterInfo)."""
    script = tmp_path / "plugins" / "sa-token"
    script.parent.mkdir()
    script.write_text(PLUGIN.format(python=sys.executable))
    script.chmod(0o755)
    (tmp_path / "token").write_text(token)
    env = {
        "RUNS_FILE": tmp_path / "runs",
        "INFO_FILE": tmp_path / "info",
        "TOKEN_FILE": tmp_path / "token",
        "LIFETIME": lifetime,
    }
    if first_token_bad:
        env["FIRST_TOKEN_BAD"] = "1"
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "./plugins/sa-token",
        "env": [{"name": k, "value": str(v)} for k, v in env.items()],
        "interactiveMode": "Never",
        "provideClusterInfo": True,
    }
    cluster_entry = {"server": cluster.server, "certificate-authority": str(cluster.ca_file)}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster_entry}],
        "users": [{"name": "u", "user": {"exec": exec_}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return Plugin(path, tmp_path / "runs", tmp_path / "info")


def test_agent_client_authenticates_through_the_exec_plugin_and_reruns_it_after_expiry(
    cluster: Cluster, tmp_path: Path, sa_token: str
) -> None:
    plugin = plugin_kubeconfig(cluster, tmp_path, sa_token, lifetime=3)

    async def scenario() -> None:
        client = KubeClient(from_kubeconfig(plugin.kubeconfig))
        try:
            first = await client.list("services", SERVICES, {})
            assert any(s["metadata"]["name"] == "kubernetes" for s in first["items"])
            await client.list("services", SERVICES, {})
            assert plugin.runs == 1  # cached until its expirationTimestamp
            spec = plugin.info["spec"]
            assert isinstance(spec, dict)
            assert spec["interactive"] is False
            assert spec["cluster"]["server"] == cluster.server  # provideClusterInfo
            await asyncio.sleep(4)  # past the credential's expiry (whole seconds, RFC 3339)
            # resourceVersion=0: served from the watch cache as it is. Without it the apiserver
            # first waits for the cache to reach etcd's latest revision, and with a 1 s timeout
            # that wait can end the watch with an ERROR event (504, "Too large resource
            # version") when other resources churn, as they do in the shared test cluster.
            watched = [
                event
                async for event in client.watch(
                    "services", SERVICES, {"timeoutSeconds": "1", "resourceVersion": "0"}
                )
            ]
            assert watched and all(e["type"] == "ADDED" for e in watched), watched
            assert any(e["object"]["metadata"]["name"] == "kubernetes" for e in watched)
            assert plugin.runs == 2
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_401_makes_the_agent_client_run_the_plugin_again(
    cluster: Cluster, tmp_path: Path, sa_token: str
) -> None:
    plugin = plugin_kubeconfig(cluster, tmp_path, sa_token, lifetime=600, first_token_bad=True)

    async def scenario() -> None:
        client = KubeClient(from_kubeconfig(plugin.kubeconfig))
        try:
            with pytest.raises(ApiError) as refused:
                await client.list("services", SERVICES, {})
            assert refused.value.status == 401
            await client.list("services", SERVICES, {})  # the reflector's retry
            assert plugin.runs == 2
        finally:
            await client.close()

    asyncio.run(scenario())


def test_operator_apiserver_authenticates_through_the_exec_plugin(
    cluster: Cluster, tmp_path: Path, sa_token: str
) -> None:
    plugin = plugin_kubeconfig(cluster, tmp_path, sa_token, lifetime=3, first_token_bad=True)

    async def scenario() -> None:
        api = ApiServer(from_kubeconfig(plugin.kubeconfig))
        try:
            with pytest.raises(OperatorApiError) as refused:
                await api.get("ConfigMap", "kube-root-ca.crt", NS)
            assert refused.value.status == 401
            found = await api.get("ConfigMap", "kube-root-ca.crt", NS)
            assert found is not None and plugin.runs == 2
            await api.get("ConfigMap", "kube-root-ca.crt", NS)
            assert plugin.runs == 2
            await asyncio.sleep(4)
            assert await api.get("ConfigMap", "kube-root-ca.crt", NS) is not None
            assert plugin.runs == 3
        finally:
            await api.close()

    asyncio.run(scenario())


def test_kopf_login_gets_the_exec_token_with_its_expiry(
    cluster: Cluster, tmp_path: Path, sa_token: str
) -> None:
    """What kopf receives: a session that authenticates as the plugin's ServiceAccount and the
    credential's expiry (kopf logs in again after it); a second login (kopf's reaction to a
    401) runs the plugin again."""
    plugin = plugin_kubeconfig(cluster, tmp_path, sa_token, lifetime=600)
    login = login_handler(from_kubeconfig(plugin.kubeconfig), "kpx-system")

    async def scenario() -> None:
        info = await login()
        assert info.server == cluster.server and info.default_namespace == "kpx-system"
        assert info.expiration is not None
        left = info.expiration - datetime.datetime.now(datetime.UTC)
        assert datetime.timedelta(seconds=500) < left < datetime.timedelta(seconds=601)
        try:
            async with info.aiohttp_session.get(f"{cluster.server}/api/v1/services") as resp:
                assert resp.status == 200, await resp.text()
            async with info.aiohttp_session.get(f"{cluster.server}/api/v1/secrets") as resp:
                assert resp.status == 403  # really the ServiceAccount (its role has no secrets)
                assert f"system:serviceaccount:{NS}:{SA}" in await resp.text()
        finally:
            await info.aiohttp_session.close()
        again = await login()
        await again.aiohttp_session.close()
        assert plugin.runs == 2

    asyncio.run(scenario())


# -- client-key-data: no key file --------------------------------------------------------------


def _open_files_holding(needle: bytes) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        link = f"/proc/self/fd/{fd}"
        try:
            target = os.readlink(link)
            if "memfd:" in target:
                found.append(target)  # an anonymous file left open
                continue
            if os.path.isfile(link):
                with open(link, "rb") as handle:
                    if needle in handle.read(1 << 20):
                        found.append(target)
        except OSError:
            continue
    return found


def test_client_key_data_leaves_no_key_file(cluster: Cluster, tmp_path: Path) -> None:
    """The admin's key, given inline, authenticates the agent client, the operator's ApiServer
    and the kopf login; afterwards no file in /tmp (nor this test's folder) holds it, and the
    process holds no descriptor to a file with it."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    user = admin["users"][0]["user"]
    key = Path(user["client-key"]).read_bytes()
    cert = Path(user["client-certificate"]).read_bytes()
    inline = {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode(),
    }
    admin["users"][0]["user"] = inline
    ca = admin["clusters"][0]["cluster"].pop("certificate-authority")
    ca_data = base64.b64encode(Path(ca).read_bytes()).decode()
    admin["clusters"][0]["cluster"]["certificate-authority-data"] = ca_data
    path = tmp_path / "inline.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    started = time.time()

    async def scenario() -> None:
        creds = from_kubeconfig(path)
        client, api = KubeClient(creds), ApiServer(creds)
        info = await login_handler(creds, "kpx-system")()
        try:
            assert (await client.list("nodes", "/api/v1/nodes", {}))["kind"] == "NodeList"
            assert await api.get("ConfigMap", "kube-root-ca.crt", NS) is not None
            async with info.aiohttp_session.get(f"{cluster.server}/api/v1/secrets") as resp:
                assert resp.status == 200  # the admin's certificate was presented
            assert _open_files_holding(key) == []
        finally:
            await client.close()
            await api.close()
            await info.aiohttp_session.close()

    asyncio.run(scenario())
    assert files_holding(key, [Path(tempfile.gettempdir()), tmp_path], started) == []


def test_kopf_runs_on_the_exec_token_and_logs_in_again_when_it_expires(
    cluster: Cluster, tmp_path: Path, sa_token: str
) -> None:
    """kopf itself (the operator's settings, the operator's login handler) watches ConfigMaps
    with the plugin's token; once the credential's expirationTimestamp has passed, kopf's next
    request (here: its watch, renewed every 2 s) logs in again (the plugin runs again), and
    events keep coming."""
    plugin = plugin_kubeconfig(cluster, tmp_path, sa_token, lifetime=3)
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login_handler(from_kubeconfig(plugin.kubeconfig), NS))
    seen: set[str] = set()

    @kopf.on.event("configmaps", registry=registry)
    def record(name: str, **_: object) -> None:
        seen.add(name)

    def configmap(name: str) -> None:
        cluster.kubectl("-n", NS, "create", "configmap", name, "--from-literal=k=v")

    async def scenario() -> None:
        stop = asyncio.Event()
        settings = operator_settings()
        settings.posting.enabled = False
        settings.watching.server_timeout = 2
        task = asyncio.create_task(
            kopf.operator(registry=registry, settings=settings, clusterwide=True, stop_flag=stop)
        )
        try:
            await wait_for(lambda: "kube-root-ca.crt" in seen, 20, "kopf's first events")
            await asyncio.to_thread(configmap, "kpx-exec-kopf-1")
            await wait_for(lambda: "kpx-exec-kopf-1" in seen, 10, "a new ConfigMap")
            await wait_for(lambda: plugin.runs >= 2, 15, "a login after the expiry")
            await asyncio.to_thread(configmap, "kpx-exec-kopf-2")
            await wait_for(lambda: "kpx-exec-kopf-2" in seen, 10, "a ConfigMap after it")
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)

    try:
        asyncio.run(scenario())
    finally:
        for name in ("kpx-exec-kopf-1", "kpx-exec-kopf-2"):
            cluster.kubectl(
                "-n", NS, "delete", "configmap", name, "--ignore-not-found", check=False
            )


async def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.1)
