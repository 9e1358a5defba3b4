"""kpx_kube: kubeconfig parsing (contexts, `~`, relative paths, errors naming the field), the
ExecCredential exchange, the exec credential cache, and key material kept off the disk."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_cluster.leaks import files_holding
from kpx_cluster.pki import CertificateAuthority
from kpx_kube import ApiError, KubeconfigError, from_kubeconfig, in_cluster
from kpx_kube import Client as KubeClient
from kpx_kube.credentials import Credentials, apiserver_candidates
from kpx_kube.exec_plugin import ExecPluginError, exec_info, parse_credential
from kpx_kube.kubeconfig import Cluster, ExecConfig, parse

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"


def doc(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "a",
        "contexts": [
            {"name": "a", "context": {"cluster": "one", "user": "alice"}},
            {"name": "b", "context": {"cluster": "two", "user": "bob"}},
        ],
        "clusters": [
            {
                "name": "one",
                "cluster": {"server": "https://one:6443/", "certificate-authority": "ca.crt"},
            },
            {
                "name": "two",
                "cluster": {
                    "server": "https://two:6443",
                    "certificate-authority": "~/certs/ca.crt",
                    "disable-compression": True,
                },
            },
        ],
        "users": [
            {"name": "alice", "user": {"token": "alice-token"}},
            {
                "name": "bob",
                "user": {
                    "client-certificate": "/abs/bob.crt",
                    "client-key": "keys/bob.key",
                    "tokenFile": "~/tok",
                },
            },
        ],
    }
    base.update(overrides)
    return base


def test_current_context_and_relative_paths_against_the_kubeconfig_folder() -> None:
    ctx = parse(doc(), Path("/etc/kube"))
    assert ctx.name == "a"
    assert ctx.cluster.server == "https://one:6443"  # trailing slash dropped
    assert ctx.cluster.certificate_authority is not None
    assert ctx.cluster.certificate_authority.path == Path("/etc/kube/ca.crt")
    assert ctx.user.token == "alice-token"
    assert not ctx.cluster.disable_compression


def test_explicit_context_home_expansion_and_absolute_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", "/home/me")
    ctx = parse(doc(), Path("/etc/kube"), context="b")
    assert ctx.name == "b"
    assert ctx.cluster.certificate_authority is not None
    assert ctx.cluster.certificate_authority.path == Path("/home/me/certs/ca.crt")
    assert ctx.cluster.disable_compression
    assert ctx.user.client_certificate is not None and ctx.user.client_key is not None
    assert ctx.user.client_certificate.path == Path("/abs/bob.crt")
    assert ctx.user.client_key.path == Path("/etc/kube/keys/bob.key")
    assert ctx.user.token_file == Path("/home/me/tok")


@pytest.mark.parametrize(
    ("change", "context", "message"),
    [
        ({}, "nope", "context: no context named 'nope'"),
        ({"current-context": None}, None, "current-context: not set"),
        ({"current-context": "zzz"}, None, "current-context: no context named 'zzz'"),
        (
            {"contexts": [{"name": "a", "context": {"cluster": "x"}}]},
            None,
            "contexts[a].context.cluster: no cluster named 'x'",
        ),
        (
            {"contexts": [{"name": "a", "context": {"cluster": "one", "user": "carol"}}]},
            None,
            "contexts[a].context.user: no user named 'carol'",
        ),
        (
            {"clusters": [{"name": "one", "cluster": {"server": "one:6443"}}]},
            None,
            "clusters[one].cluster.server: an http(s) URL is needed",
        ),
        (
            {
                "clusters": [
                    {
                        "name": "one",
                        "cluster": {"server": "https://one", "certificate-authority-data": "%%"},
                    }
                ]
            },
            None,
            "clusters[one].cluster.certificate-authority-data: not base64",
        ),
        (
            {
                "clusters": [
                    {
                        "name": "one",
                        "cluster": {"server": "https://one", "proxy-url": "http://proxy"},
                    }
                ]
            },
            None,
            "clusters[one].cluster.proxy-url: not supported",
        ),
        (
            {"users": [{"name": "alice", "user": {"client-key-data": "a2V5"}}]},
            None,
            "users[alice].user.client-certificate: needed with the other half",
        ),
        (
            {
                "users": [
                    {
                        "name": "alice",
                        "user": {
                            "client-key": "k",
                            "client-key-data": "a2V5",
                            "client-certificate": "c",
                        },
                    }
                ]
            },
            None,
            "users[alice].user: client-key and client-key-data are both set",
        ),
        (
            {"users": [{"name": "alice", "user": {"auth-provider": {"name": "gcp"}}}]},
            None,
            "users[alice].user.auth-provider: not supported",
        ),
        (
            {"users": [{"name": "alice", "user": {"exec": {"apiVersion": V1}}}]},
            None,
            "users[alice].user.exec.command: missing",
        ),
        (
            {"users": [{"name": "alice", "user": {"exec": {"command": "x", "apiVersion": "v9"}}}]},
            None,
            "users[alice].user.exec.apiVersion: 'v9' is not one of",
        ),
        (
            {"users": [{"name": "alice", "user": {"exec": {"command": "x", "apiVersion": V1}}}]},
            None,
            "users[alice].user.exec.interactiveMode: required by " + V1,
        ),
        (
            {
                "users": [
                    {
                        "name": "alice",
                        "user": {"token": "t", "exec": {"command": "x", "apiVersion": V1BETA1}},
                    }
                ]
            },
            None,
            "users[alice].user: exec and token/tokenFile are both set",
        ),
    ],
)
def test_errors_name_the_field(change: dict[str, Any], context: str | None, message: str) -> None:
    with pytest.raises(KubeconfigError) as err:
        parse(doc(**change), Path("/k"), context=context)
    assert message in str(err.value)


def test_unreadable_and_merged_kubeconfigs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="several kubeconfig files"):
        from_kubeconfig(Path(f"{tmp_path}/a:{tmp_path}/b"))
    with pytest.raises(KubeconfigError, match="No such file"):
        from_kubeconfig(tmp_path / "missing")
    (tmp_path / "ca.yaml").write_text(yaml.safe_dump(doc()))
    with pytest.raises(
        KubeconfigError, match=r"clusters\[one\]\.cluster\.certificate-authority: cannot read"
    ):
        from_kubeconfig(tmp_path / "ca.yaml")


def test_exec_config_command_resolution_env_and_defaults() -> None:
    exec_raw = {
        "apiVersion": V1BETA1,
        "command": "./bin/get-token",
        "args": ["--x", "y z"],
        "env": [{"name": "A", "value": "1"}],
        "installHint": "install it",
        "provideClusterInfo": True,
    }
    users = [{"name": "alice", "user": {"exec": exec_raw}}]
    ctx = parse(doc(users=users), Path("/etc/kube"))
    ex = ctx.user.exec
    assert ex is not None
    assert ex.command == "/etc/kube/bin/get-token"  # a path: against the kubeconfig's folder
    assert ex.args == ("--x", "y z")
    assert ex.env == (("A", "1"),)
    assert ex.interactive_mode == "IfAvailable"  # v1beta1's default
    assert ex.provide_cluster_info
    bare = parse(
        doc(
            users=[
                {
                    "name": "alice",
                    "user": {
                        "exec": {"apiVersion": V1, "command": "aws", "interactiveMode": "Never"}
                    },
                }
            ]
        ),
        Path("/etc/kube"),
    )
    assert bare.user.exec is not None and bare.user.exec.command == "aws"  # looked up in PATH


def test_exec_info_carries_the_cluster_only_when_asked() -> None:
    cluster = Cluster(
        server="https://one:6443",
        insecure_skip_tls_verify=True,
        disable_compression=True,
        exec_config={"audience": "x"},
    )
    plain = exec_info(ExecConfig(command="x", api_version=V1), cluster, b"CA")
    assert plain == {"apiVersion": V1, "kind": "ExecCredential", "spec": {"interactive": False}}
    full = exec_info(
        ExecConfig(command="x", api_version=V1, provide_cluster_info=True), cluster, b"CA"
    )
    assert full["spec"]["cluster"] == {
        "server": "https://one:6443",
        "insecure-skip-tls-verify": True,
        "certificate-authority-data": base64.b64encode(b"CA").decode(),
        "disable-compression": True,
        "config": {"audience": "x"},
    }


def credential(status: Any, api_version: str = V1) -> bytes:
    return json.dumps(
        {"apiVersion": api_version, "kind": "ExecCredential", "status": status}
    ).encode()


def test_parse_credential() -> None:
    cfg = ExecConfig(command="plug", api_version=V1)
    cred = parse_credential(
        credential({"token": "t", "expirationTimestamp": "2030-01-02T03:04:05Z"}), cfg
    )
    assert cred.token == "t"
    assert cred.expires == datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    pair = parse_credential(credential({"clientCertificateData": "C", "clientKeyData": "K"}), cfg)
    assert (pair.token, pair.cert, pair.key, pair.expires) == (None, b"C", b"K", None)
    for raw, message in [
        (b"not json", "stdout is not JSON"),
        (credential({"token": "t"}, V1BETA1), "answered apiVersion"),
        (credential(None), "has no status"),
        (credential({}), "no token"),
        (credential({"clientKeyData": "K"}), "only one of"),
        (credential({"token": "t", "expirationTimestamp": "soon"}), "not an RFC 3339 time"),
    ]:
        with pytest.raises(ExecPluginError, match=message):
            parse_credential(raw, cfg)


def test_token_file_is_read_again_for_each_request(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("one\n")
    users = [{"name": "alice", "user": {"tokenFile": "token"}}]  # relative to the kubeconfig
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            doc(users=users, clusters=[{"name": "one", "cluster": {"server": "https://one"}}])
        )
    )
    creds = from_kubeconfig(path)
    assert asyncio.run(creds.auth()).headers() == {"Authorization": "Bearer one"}
    token.write_text("two")
    assert asyncio.run(creds.auth()).token == "two"


def test_in_cluster_reads_the_projected_token_again(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa" / "ca.crt").write_bytes(ca.pair.cert.read_bytes())
    (tmp_path / "sa" / "token").write_text("first")
    env = {
        "KUBERNETES_SERVICE_HOST": "fd00::1",
        "KUBERNETES_SERVICE_PORT": "6443",
        "KPX_SERVICEACCOUNT_DIR": str(tmp_path / "sa"),
    }
    creds = in_cluster(env)
    assert creds.server == "https://[fd00::1]:6443"
    assert creds.ssl_context.cert_store_stats()["x509_ca"] == 1
    assert asyncio.run(creds.auth()).token == "first"
    (tmp_path / "sa" / "token").write_text("rotated")
    assert asyncio.run(creds.auth()).token == "rotated"
    with pytest.raises(KubeconfigError, match="not in a cluster"):
        in_cluster({})


def test_in_cluster_prefers_the_apiserver_addresses_to_the_service_vip(tmp_path: Path) -> None:
    """After a node reboot without kube-proxy nothing answers the `kubernetes` Service IP until
    the agent programmed it: the agent must reach the apiserver at its own addresses."""
    ca = CertificateAuthority(tmp_path / "pki")
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa" / "ca.crt").write_bytes(ca.pair.cert.read_bytes())
    (tmp_path / "sa" / "token").write_text("t")
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KPX_APISERVER_ENDPOINTS": "192.0.2.10:6443,[2001:db8::10]:6443",
        "KPX_SERVICEACCOUNT_DIR": str(tmp_path / "sa"),
    }
    assert apiserver_candidates(env) == [
        ("192.0.2.10", 6443),
        ("2001:db8::10", 6443),
        ("10.96.0.1", 443),
    ]
    tried: list[tuple[str, int]] = []

    def only_v6(host: str, port: int) -> bool:
        tried.append((host, port))
        return host == "2001:db8::10"

    assert in_cluster(env, only_v6).server == "https://[2001:db8::10]:6443"
    assert tried == [("192.0.2.10", 6443), ("2001:db8::10", 6443)]
    # Nothing answers: the first address (the client retries it), never an exception.
    assert in_cluster(env, lambda h, p: False).server == "https://192.0.2.10:6443"
    # One candidate: no probe at all.
    alone = {k: v for k, v in env.items() if k != "KPX_APISERVER_ENDPOINTS"}
    assert in_cluster(alone, lambda h, p: pytest.fail("probed")).server == "https://10.96.0.1:443"
    with pytest.raises(KubeconfigError, match="KPX_APISERVER_ENDPOINTS: 'nope' is not host:port"):
        in_cluster({**env, "KPX_APISERVER_ENDPOINTS": "nope"})


# -- the exec credential cache, with a real plugin process ----------------------------------------

PLUGIN = """#!{python}
import json, os, sys
count = os.environ["COUNT_FILE"]
n = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(n))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
if sys.stdin.read(1):
    sys.exit("stdin should be empty")
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {{"token": f"token-{{n}}-" + sys.argv[1],
                             "expirationTimestamp": "2030-01-01T00:00:00Z"}}}}))
"""


def plugin_kubeconfig(tmp_path: Path) -> Path:
    script = tmp_path / "bin" / "plugin"
    script.parent.mkdir()
    script.write_text(PLUGIN.format(python=sys.executable))
    script.chmod(0o755)
    count = {"name": "COUNT_FILE", "value": str(tmp_path / "count")}
    exec_raw = {
        "apiVersion": V1,
        "command": "bin/plugin",
        "args": ["arg"],
        "interactiveMode": "Never",
        "env": [count],
    }
    config = doc(
        clusters=[{"name": "one", "cluster": {"server": "https://one:6443"}}],
        users=[{"name": "alice", "user": {"exec": exec_raw}}],
    )
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_exec_credential_is_cached_until_expiry_and_rerun_after_it_and_after_401(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [datetime.datetime(2029, 12, 31, 23, 0, tzinfo=datetime.UTC)]
    creds = from_kubeconfig(plugin_kubeconfig(tmp_path))
    monkeypatch.setattr(creds, "_clock", lambda: now[0])

    async def scenario() -> list[str | None]:
        tokens = []
        first = await creds.auth()
        tokens.append(first.token)
        tokens.append((await creds.auth()).token)  # cached
        now[0] = datetime.datetime(2030, 1, 1, 0, 0, 1, tzinfo=datetime.UTC)  # past expiry
        second = await creds.auth()
        tokens.append(second.token)
        now[0] = datetime.datetime(2029, 12, 31, 23, 30, tzinfo=datetime.UTC)  # a fake clock
        creds.invalidate(first)  # a stale 401: the credential was already replaced
        tokens.append((await creds.auth()).token)
        creds.invalidate(second)  # 401 to the current credential: run again
        tokens.append((await creds.auth()).token)
        return tokens

    tokens = asyncio.run(scenario())
    assert tokens == ["token-1-arg", "token-1-arg", "token-2-arg", "token-2-arg", "token-3-arg"]
    assert creds.exec_runs == 3
    assert first_auth_header(creds) == {"Authorization": "Bearer token-3-arg"}


def first_auth_header(creds: Credentials) -> dict[str, str]:
    return asyncio.run(creds.auth()).headers()


def test_exec_plugin_missing_gives_the_install_hint(tmp_path: Path) -> None:
    config = doc(
        users=[
            {
                "name": "alice",
                "user": {
                    "exec": {
                        "apiVersion": V1,
                        "command": "/nonexistent/kpx-plugin",
                        "interactiveMode": "Never",
                        "installHint": "get it from example.org",
                    }
                },
            }
        ],
        clusters=[{"name": "one", "cluster": {"server": "https://one"}}],
    )
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    creds = from_kubeconfig(path)
    with pytest.raises(ExecPluginError, match=r"exec\.command: cannot run .*get it from example"):
        asyncio.run(creds.auth())

    async def agent_list() -> None:  # the agent's reflector retries an ApiError with backoff
        client = KubeClient(creds)
        try:
            await client.list("services", "/api/v1/services", {})
        finally:
            await client.close()

    with pytest.raises(ApiError, match=r"credentials: .*cannot run") as err:
        asyncio.run(agent_list())
    assert err.value.status == 0


def exec_kubeconfig(tmp_path: Path, script: str) -> Path:
    """A kubeconfig whose user runs `script` with this Python as its exec plugin."""
    config = doc(
        users=[
            {
                "name": "alice",
                "user": {
                    "exec": {
                        "apiVersion": V1,
                        "command": sys.executable,
                        "args": ["-c", script],
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        clusters=[{"name": "one", "cluster": {"server": "https://one"}}],
    )
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_exec_plugin_that_hangs_is_killed_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin past its time (60 s; 1 s here) is killed, and the error names the user's exec
    and the time, instead of the agent waiting for it for good."""
    from kpx_kube import exec_plugin

    monkeypatch.setattr(exec_plugin, "RUN_TIMEOUT", 1.0)
    pid_file = tmp_path / "plugin.pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    )
    creds = from_kubeconfig(exec_kubeconfig(tmp_path, script))
    with pytest.raises(ExecPluginError, match=r"users\[alice\]\.user\.exec: .* took more than 1 s"):
        asyncio.run(creds.auth())
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(pid, 0)


def test_an_exec_plugin_that_fails_gives_its_exit_code_and_stderr(tmp_path: Path) -> None:
    script = "import sys; sys.stderr.write('no cloud login'); sys.exit(3)"
    creds = from_kubeconfig(exec_kubeconfig(tmp_path, script))
    with pytest.raises(ExecPluginError, match=r"exited with 3: no cloud login"):
        asyncio.run(creds.auth())


# -- key material ----------------------------------------------------------------------------------


def config(user: dict[str, Any], cluster: dict[str, Any]) -> dict[str, Any]:
    users = [{"name": "alice", "user": user}]
    return doc(users=users, clusters=[{"name": "one", "cluster": cluster}])


def test_the_leak_scan_finds_a_new_file_with_the_secret_and_skips_old_ones(tmp_path: Path) -> None:
    started = time.time()
    (tmp_path / "deep" / "er").mkdir(parents=True)
    new = tmp_path / "deep" / "er" / "new"
    new.write_bytes(b"head SECRET tail")
    old = tmp_path / "old"
    old.write_bytes(b"SECRET")
    os.utime(old, (started - 60, started - 60))
    (tmp_path / "link").symlink_to(new)
    (tmp_path / "other").write_bytes(b"nothing here")
    assert files_holding(b"SECRET", [tmp_path], started) == [new]


def test_key_data_is_loaded_without_a_file(tmp_path: Path) -> None:
    """client-key-data reaches the SSL context; no file with the key exists afterwards, and
    the process holds no descriptor to one (the memfd is closed once loaded)."""
    ca = CertificateAuthority(tmp_path / "pki")
    pair = ca.issue("client", "alice")
    key = pair.key.read_bytes()
    started = time.time()
    user = {
        "client-certificate-data": base64.b64encode(pair.cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(key).decode(),
    }
    ca_data = base64.b64encode(ca.pair.cert.read_bytes()).decode()
    cluster = {"server": "https://one", "certificate-authority-data": ca_data}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config(user, cluster)))
    pair.key.unlink()  # the only file holding the key is gone: the kubeconfig has it in base64
    fds_before = set(os.listdir("/proc/self/fd"))
    creds = from_kubeconfig(path)
    assert creds.ssl_context.cert_store_stats()["x509_ca"] == 1
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert files_holding(key, [tmp_path, Path(tempfile.gettempdir())], started) == []
    # The pair really was loaded: a wrong key for the certificate is refused, naming the context.
    other = ca.issue("other", "bob").key.read_bytes()
    user["client-key-data"] = base64.b64encode(other).decode()
    path.write_text(yaml.safe_dump(config(user, cluster)))
    with pytest.raises(KubeconfigError, match=r"context a: .*client key pair is unusable"):
        from_kubeconfig(path)


def test_apiserver_sockets_carry_bounded_keepalive() -> None:
    import socket

    from kpx_kube import tcp

    sock = tcp.socket_factory((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ()))
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000
    finally:
        sock.close()
