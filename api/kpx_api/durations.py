"""Go duration strings (``30s``, ``1m30s``, ``500ms``), as the API spells time spans."""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import AfterValidator

from kpx_api.validation import Text, invalid

#: A Go duration without sign: one or more <number><unit> (ns, us, µs, ms, s, m, h).
DURATION_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
DURATION_MAX_LENGTH: Final = 32

_UNIT_SECONDS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
_WHOLE = re.compile(DURATION_PATTERN)

#: Go's time.Duration is an int64 of nanoseconds: about 2562047 hours.
MAX_DURATION_SECONDS: Final = (2**63 - 1) / 1e9


def is_duration(text: str) -> bool:
    """Whether `text` is a duration this API accepts."""
    return _WHOLE.fullmatch(text) is not None


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string: ``parse_duration("1m30s") == 90.0``.

    Raises ValueError for anything `DURATION_PATTERN` rejects (signs, a bare ``0``, spaces).
    """
    if not is_duration(text):
        raise ValueError(f"invalid duration {text!r}: expected e.g. 30s, 1m30s, 500ms or 1h")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in _PART.findall(text))


def format_duration(seconds: float) -> str:
    """The shortest Go-style spelling of a non-negative number of seconds (``90`` -> ``1m30s``)."""
    if seconds < 0:
        raise ValueError("durations are never negative")
    if seconds == 0:
        return "0s"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if secs:
        out += f"{round(secs * 1000)}ms" if secs < 1 and not out else f"{secs:g}s"
    return out


def _check_range(text: str) -> str:
    if parse_duration(text) > MAX_DURATION_SECONDS:
        raise invalid("must be at most 2562047h (the largest Go duration)")
    return text


DURATION_MESSAGE: Final = (
    "must be a duration such as 30s, 1m30s, 500ms or 1h (units: ns, us, ms, s, m, h)"
)

#: A duration field: kept as the string the user wrote; `parse_duration` gives seconds.
Duration = Annotated[
    str,
    Text(max_length=DURATION_MAX_LENGTH, pattern=DURATION_PATTERN, message=DURATION_MESSAGE),
    AfterValidator(_check_range),
]
