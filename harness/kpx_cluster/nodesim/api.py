"""The node simulator's Kubernetes client: kpx_kube's, with the calls the kubelets make.

Each simulated kubelet talks to the apiserver with its node's own client certificate (user
``system:node:<name>``, group ``system:nodes``), so the Node authorizer and the NodeRestriction
admission plugin judge every request exactly as they would a real kubelet's.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import kpx_kube as kube
from kpx_kube import ApiError

__all__ = ["ApiError", "Credentials", "KubeApi", "Obj", "now_micro", "now_rfc3339"]

Obj = dict[str, Any]
"""A Kubernetes object (or any JSON document) as plain dicts."""

# Beyond the kubelets' watch timeoutSeconds (290): the server ends a healthy watch first.
WATCH_IDLE_TIMEOUT = 300.0


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes `metav1.Time` (whole seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """The current UTC time as Kubernetes `metav1.MicroTime` (leases)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Credentials:
    """Where the apiserver is and how to authenticate: kpx_kube's credentials."""

    @staticmethod
    def from_kubeconfig(path: Path) -> kube.Credentials:
        return kube.from_kubeconfig(path)


class KubeApi:
    """JSON requests and watches against one apiserver with one identity (kpx_kube's client).

    The connections are made on first use, so the object may be built outside the event
    loop that later uses it (but must then stay on that loop).
    """

    def __init__(self, creds: kube.Credentials, user_agent: str) -> None:
        self.creds = creds
        self.client = kube.Client(
            creds, user_agent=user_agent, connections=8, watch_idle_timeout=WATCH_IDLE_TIMEOUT
        )

    async def close(self) -> None:
        await self.client.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Obj | None = None,
        patch: str | None = None,
        timeout: float = 30,
    ) -> Obj:
        """One request; the decoded JSON answer. Raises kpx_kube's ApiError on a non-2xx
        status (Unreachable without an answer).

        `patch` ("merge" or "strategic") selects the patch content type for PATCH requests.
        """
        reply = await self.client.request(
            method, path, params=params, body=body, content=patch or "json", timeout=timeout
        )
        return reply.body

    async def get_or_none(self, path: str) -> Obj | None:
        """GET `path`; None when it does not exist (404)."""
        return await self.client.get_or_none(path)

    def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """Watch events ({type, object}) until the server ends the watch."""
        return self.client.watch(path, path, params)
