"""Kubeconfig files for the local cluster's users (admin, components, agents)."""

from __future__ import annotations

from pathlib import Path

import yaml

from .pki import KeyPair


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca: Path,
    user: str,
    client: KeyPair | None = None,
    token_file: Path | None = None,
) -> Path:
    """Write a single-context kubeconfig that authenticates with a client cert or a token file."""
    credentials: dict[str, str] = {}
    if client is not None:
        credentials = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    elif token_file is not None:
        credentials = {"tokenFile": str(token_file)}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kpx", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "kpx", "context": {"cluster": "kpx", "user": user}}],
        "current-context": "kpx",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
