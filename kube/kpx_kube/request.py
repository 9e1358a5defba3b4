"""How a request to the apiserver is built (pure): method, path, query, headers, body bytes.

Bodies are JSON (orjson); the Content-Type says what a PATCH means: `merge`
(application/merge-patch+json), `strategic`, `json` (a JSON Patch list), or `apply`
(server-side apply: application/apply-patch+yaml, of which JSON is a subset, with a
fieldManager and, with `force`, taking over fields other managers own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

CONTENT_TYPES: Final[dict[str, str]] = {
    "json": "application/json",  # POST, PUT
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json-patch": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # from the server's root, e.g. /api/v1/namespaces/x/pods
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes | None = None

    @property
    def what(self) -> str:
        """For messages: "GET /api/v1/pods"."""
        return f"{self.method} {self.path}"


def build(
    method: str,
    path: str,
    *,
    params: Mapping[str, str] | None = None,
    body: Any = None,
    content: str = "json",
    user_agent: str = "kpx",
    token: str | None = None,
    compression: bool = True,
) -> Request:
    """One request. `content` names the body's Content-Type (see CONTENT_TYPES)."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r}: a path from the server's root is needed")
    headers = {"Accept": "application/json", "User-Agent": user_agent}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if not compression:  # the kubeconfig's disable-compression
        headers["Accept-Encoding"] = "identity"
    data = None
    if body is not None:
        headers["Content-Type"] = CONTENT_TYPES[content]
        data = orjson.dumps(body)
    return Request(method.upper(), path, dict(params or {}), headers, data)


def apply_params(
    field_manager: str, *, force: bool = True, dry_run: bool = False
) -> dict[str, str]:
    """The query of a server-side apply."""
    if not field_manager:
        raise ValueError("server-side apply needs a field manager")
    params = {"fieldManager": field_manager}
    if force:
        params["force"] = "true"
    if dry_run:
        params["dryRun"] = "All"
    return params


def object_path(
    prefix: str, plural: str, name: str | None = None, namespace: str | None = None
) -> str:
    """/api/v1/namespaces/<ns>/<plural>/<name> and its cluster-scoped and collection forms;
    `prefix` is /api/v1 or /apis/<group>/<version>."""
    base = f"{prefix}/namespaces/{namespace}" if namespace else prefix
    return f"{base}/{plural}" + (f"/{name}" if name else "")
