"""kpx_kube without a server: the error an answer becomes, and how a request is built."""

from __future__ import annotations

import orjson
import pytest

from kpx_kube import errors
from kpx_kube.client import event_error
from kpx_kube.errors import (
    AlreadyExists,
    ApiError,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    ServerError,
    Unauthorized,
    Unreachable,
    WatchIdle,
)
from kpx_kube.kinds import BUILTIN, prefix_of
from kpx_kube.request import CONTENT_TYPES, apply_params, build, object_path
from kpx_operator.apiserver import KINDS as OPERATOR_KINDS
from kpx_operator.apiserver import object_path as operator_path


def status_doc(code: int, reason: str, message: str) -> bytes:
    return orjson.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": message,
        }
    )


@pytest.mark.parametrize(
    ("code", "reason", "cls"),
    [
        (401, "Unauthorized", Unauthorized),
        (403, "Forbidden", Forbidden),
        (404, "NotFound", NotFound),
        (409, "Conflict", Conflict),
        (409, "AlreadyExists", AlreadyExists),
        (410, "Expired", Gone),
        (410, "Gone", Gone),
        (500, "InternalError", ServerError),
        (503, "ServiceUnavailable", ServerError),
        (418, "Teapot", ApiError),
    ],
)
def test_an_error_answer_becomes_the_class_of_its_status(
    code: int, reason: str, cls: type[ApiError]
) -> None:
    err = errors.from_response(code, status_doc(code, reason, "it says why"), "GET /x")
    assert type(err) is cls
    assert (err.status, err.reason, err.message) == (code, reason, "it says why")
    assert str(err) == f"{reason} ({code}): it says why"


def test_already_exists_is_a_conflict_and_every_error_an_api_error() -> None:
    err = errors.from_response(409, status_doc(409, "AlreadyExists", "x exists"))
    assert isinstance(err, Conflict) and isinstance(err, ApiError)
    assert isinstance(WatchIdle("quiet"), Unreachable)
    assert WatchIdle("quiet").status == 0


def test_a_body_that_is_not_a_status_is_kept_in_the_message() -> None:
    err = errors.from_response(502, b"<html>bad gateway</html>", "GET /api/v1/pods")
    assert type(err) is ServerError
    assert err.message == "GET /api/v1/pods: <html>bad gateway</html>"
    assert errors.from_response(404, b"", "GET /y").message == "GET /y: "


def test_unreachable_has_no_status() -> None:
    err = Unreachable("GET /x: connection refused")
    assert (err.status, err.reason, str(err)) == (0, "Unreachable", "GET /x: connection refused")


def test_a_watch_error_event_is_its_status() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    gone = event_error({"type": "ERROR", "object": status})
    assert isinstance(gone, Gone) and gone.message == "too old"
    assert event_error({"type": "ADDED", "object": {}}) is None
    assert type(event_error({"type": "ERROR", "object": None})) is ApiError


def test_make_error_keeps_the_old_constructor_order() -> None:
    err = errors.make_error(403, "Forbidden", "daemonsets.apps is forbidden")
    assert isinstance(err, Forbidden) and err.status == 403


# -- requests ----------------------------------------------------------------------------------


def test_a_get_has_no_body_and_carries_the_token() -> None:
    req = build("get", "/api/v1/pods", params={"limit": "5"}, token="t0k", user_agent="me")
    assert (req.method, req.path, req.params, req.data) == (
        "GET",
        "/api/v1/pods",
        {"limit": "5"},
        None,
    )
    assert req.headers == {
        "Accept": "application/json",
        "User-Agent": "me",
        "Authorization": "Bearer t0k",
    }
    assert req.what == "GET /api/v1/pods"


def test_without_token_there_is_no_authorization_and_compression_can_be_refused() -> None:
    req = build("GET", "/api", compression=False)
    assert "Authorization" not in req.headers
    assert req.headers["Accept-Encoding"] == "identity"
    assert "Accept-Encoding" not in build("GET", "/api").headers


@pytest.mark.parametrize("content", sorted(CONTENT_TYPES))
def test_a_body_is_json_with_the_content_type_of_its_patch(content: str) -> None:
    body = {"metadata": {"name": "x", "labels": {"a": None}}}
    req = build("PATCH", "/api/v1/namespaces/x", body=body, content=content)
    assert req.headers["Content-Type"] == CONTENT_TYPES[content]
    assert req.data is not None and orjson.loads(req.data) == body


def test_server_side_apply_needs_a_field_manager_and_forces_by_default() -> None:
    assert apply_params("kpx-operator") == {"fieldManager": "kpx-operator", "force": "true"}
    assert apply_params("m", force=False, dry_run=True) == {"fieldManager": "m", "dryRun": "All"}
    with pytest.raises(ValueError, match="field manager"):
        apply_params("")
    assert CONTENT_TYPES["apply"] == "application/apply-patch+yaml"


def test_a_path_from_the_root_is_needed() -> None:
    with pytest.raises(ValueError):
        build("GET", "api/v1/pods")


def test_object_paths() -> None:
    assert object_path("/api/v1", "pods", "p", "ns") == "/api/v1/namespaces/ns/pods/p"
    assert object_path("/api/v1", "nodes", "n1") == "/api/v1/nodes/n1"
    assert object_path("/apis/apps/v1", "daemonsets", None, "kube-system") == (
        "/apis/apps/v1/namespaces/kube-system/daemonsets"
    )


def test_the_builtin_kinds_table_gives_paths_without_discovery() -> None:
    assert BUILTIN["EndpointSlice"].path("s", "ns") == (
        "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/s"
    )
    assert BUILTIN["Node"].path("n1", "ignored") == "/api/v1/nodes/n1"
    assert (
        BUILTIN["Lease"].path(None, "kpx") == "/apis/coordination.k8s.io/v1/namespaces/kpx/leases"
    )
    with pytest.raises(ValueError, match="namespaced"):
        BUILTIN["Pod"].path("p")
    assert prefix_of("v1") == "/api/v1" and prefix_of("apps/v1") == "/apis/apps/v1"
    # The operator's kinds are kpx_kube's, plus its own CRD's.
    assert {k: OPERATOR_KINDS[k] for k in ("ConfigMap", "DaemonSet")} == {
        k: BUILTIN[k] for k in ("ConfigMap", "DaemonSet")
    }
    assert operator_path("ProxyConfiguration", "px") == (
        "/apis/proxy.kpx.dev/v1alpha1/proxyconfigurations/px"
    )
