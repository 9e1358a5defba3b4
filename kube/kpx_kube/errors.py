"""What the apiserver refused, as types: one `ApiError` hierarchy for every client.

An error answer of the apiserver is a `metav1.Status` (`reason`, `message`, `code`);
`from_response` turns it into the class of its HTTP status (`NotFound`, `Conflict`, ...), so
callers write `except NotFound:` instead of comparing numbers. `status` 0 means there was no
answer: the apiserver could not be reached, or this client could not obtain its credentials
(`Unreachable`). An answer's `Retry-After` header (429 and 5xx, in whole seconds, as client-go
reads it) is kept on the error as `retry_after`.
"""

from __future__ import annotations

from typing import Any

import orjson


class ApiError(RuntimeError):
    """The apiserver refused a request (`status` its HTTP status), or none could be made
    (`status` 0, `Unreachable`)."""

    status: int = 0

    def __init__(
        self, status: int, reason: str = "", message: str = "", retry_after: float | None = None
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        #: The answer's Retry-After (seconds), when it had one.
        self.retry_after = retry_after
        text = f"{reason or 'Error'} ({status}): {message}" if status else message
        super().__init__(text)


class Unreachable(ApiError):
    """No answer: connection refused or lost, a timeout, or credentials that cannot be
    obtained (an exec plugin that fails, an unreadable token file)."""

    def __init__(self, message: str, reason: str = "Unreachable") -> None:
        super().__init__(0, reason, message)


class WatchIdle(Unreachable):
    """No byte arrived on a watch for its idle timeout: the connection may be half-open."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "WatchIdle")


class BadRequest(ApiError):
    """400."""


class Unauthorized(ApiError):
    """401: the credentials were not accepted."""


class Forbidden(ApiError):
    """403: authenticated, but RBAC (or an admission plugin) does not allow it."""


class NotFound(ApiError):
    """404."""


class Conflict(ApiError):
    """409: a stale resourceVersion, or a field owned by another manager (apply)."""


class AlreadyExists(Conflict):
    """409 with reason AlreadyExists: a create of an existing name."""


class Gone(ApiError):
    """410 (reason Expired or Gone): the resourceVersion is older than the server keeps."""


class Invalid(ApiError):
    """422: the object fails validation."""


class TooManyRequests(ApiError):
    """429: throttled (API priority and fairness); retry later."""


class ServerError(ApiError):
    """5xx."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    422: Invalid,
    429: TooManyRequests,
}


def error_class(status: int, reason: str = "") -> type[ApiError]:
    """The class for an answer's status (and reason, for 409 AlreadyExists)."""
    if status == 409 and reason == "AlreadyExists":
        return AlreadyExists
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, ApiError)


def make_error(
    status: int, reason: str = "", message: str = "", retry_after: float | None = None
) -> ApiError:
    """An error of the class its status says, e.g. make_error(404, "NotFound", "...")."""
    return error_class(status, reason)(status, reason, message, retry_after)


def retry_after(status: int, header: str | None) -> float | None:
    """The seconds a `Retry-After` header asks to wait, on a 429 or 5xx answer; None without
    one. As client-go (rest.checkWait): whole seconds only; a date or garbage counts as none."""
    if header is None or not (status == 429 or status >= 500):
        return None
    try:
        seconds = int(header.strip())
    except ValueError:
        return None
    return float(seconds) if seconds >= 0 else None


def _code(value: Any) -> int:
    """A Status's `code` as an HTTP status; 0 (unknown) for anything else than a whole number
    between 0 and 999 (or its digits)."""
    if isinstance(value, str) and value.isdecimal() and len(value) <= 3:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 999:
        return value
    return 0


def from_status(doc: Any, status: int | None = None, retry_after: float | None = None) -> ApiError:
    """A metav1.Status document (an error answer, or a watch's ERROR event object) -> error."""
    if not isinstance(doc, dict):
        doc = {}
    code = status if status is not None else _code(doc.get("code"))
    reason, message = str(doc.get("reason") or ""), str(doc.get("message") or "")
    return make_error(code, reason, message, retry_after)


def from_response(
    status: int, body: bytes, what: str = "", retry_after: float | None = None
) -> ApiError:
    """An error answer (its HTTP status and raw body) -> error; `what` (e.g. "GET /api/v1/x")
    prefixes the message when the body is not a Status; `retry_after` from its header."""
    try:
        doc = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        return from_status(doc, status, retry_after)
    text = body[:500].decode(errors="replace").strip()
    return make_error(status, "", f"{what}: {text}" if what else text, retry_after)
