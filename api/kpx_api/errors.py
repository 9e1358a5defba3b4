"""Readable validation errors: one line per bad field, each naming the field's path."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from kpx_api.validation import RULE_ERROR


@dataclass(frozen=True)
class FieldError:
    """One problem: the field's path in API (camelCase) names, and what is wrong with it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(ValueError):
    """A configuration (file or object) that does not validate.

    ``str()`` gives one line per problem, ``<source>: <field path>: <message>``, e.g.
    ``spec: nftables.masqueradeBit: must be <= 31 (got 40)``.
    """

    def __init__(self, source: str, errors: Sequence[FieldError]) -> None:
        self.source = source
        self.errors = tuple(errors)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {error}" for error in self.errors)

    @classmethod
    def from_validation_error(cls, exc: ValidationError, source: str) -> ConfigError:
        """Translate pydantic's errors into field errors."""
        return cls(source, field_errors(exc))


def format_path(loc: Sequence[int | str]) -> str:
    """``("nftables", "masqueradeBit")`` -> ``nftables.masqueradeBit``; list indexes as ``[i]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("["):
            out += part
        else:
            out += f".{part}" if out else part
    return out


_SCALARS = (str, int, float, bool)


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    messages = {
        "less_than_equal": lambda: f"must be <= {ctx['le']}",
        "greater_than_equal": lambda: f"must be >= {ctx['ge']}",
        "less_than": lambda: f"must be < {ctx['lt']}",
        "greater_than": lambda: f"must be > {ctx['gt']}",
        "missing": lambda: "required field is missing",
        "extra_forbidden": lambda: "unknown field",
        "enum": lambda: f"must be one of {ctx['expected']}",
        "literal_error": lambda: f"must be {ctx['expected']}",
        "int_type": lambda: "must be an integer",
        "int_parsing": lambda: "must be an integer",
        "int_from_float": lambda: "must be an integer",
        "bool_type": lambda: "must be a boolean (true or false)",
        "bool_parsing": lambda: "must be a boolean (true or false)",
        "string_type": lambda: "must be a string",
        "list_type": lambda: "must be a list",
        "dict_type": lambda: "must be a mapping",
        "model_type": lambda: "must be a mapping",
        "model_attributes_type": lambda: "must be a mapping",
        "too_long": lambda: f"must have at most {ctx['max_length']} items",
        "too_short": lambda: f"must have at least {ctx['min_length']} items",
        "string_too_long": lambda: f"must be at most {ctx['max_length']} characters",
        "string_too_short": lambda: f"must be at least {ctx['min_length']} characters",
        "string_pattern_mismatch": lambda: f"must match {ctx['pattern']}",
    }
    make = messages.get(kind)
    message = make() if make is not None else error["msg"]
    value = error.get("input")
    if kind not in ("missing", "extra_forbidden") and isinstance(value, _SCALARS):
        message += f" (got {json.dumps(value, ensure_ascii=False)})"
    return message


def field_errors(exc: ValidationError) -> list[FieldError]:
    """One `FieldError` per pydantic error, with the path in the API's field names."""
    out: list[FieldError] = []
    for error in exc.errors():
        loc: list[int | str] = list(error["loc"])
        if error["type"] == RULE_ERROR:
            sub = (error.get("ctx") or {}).get("field_path")
            if sub:
                loc.extend(str(sub).split(".") if not str(sub).startswith("[") else [str(sub)])
        out.append(FieldError(format_path(loc), _message(error)))
    return out
