"""Validation building blocks shared by the models and the CRD generator.

Every check the apiserver makes through the CRD's OpenAPI schema or its CEL rules is also made
in Python, from one declaration next to the field it guards:

* `Rule`: a CEL rule (published as ``x-kubernetes-validations``) and its Python twin.
* `Cel`: an annotation attaching rules to a field's type (scalar, list or map).
* `Text`: a string with length and pattern limits (``maxLength``/``pattern`` in the CRD) that
  Python reports with a readable message instead of the raw regular expression.
* `SetList`: a list of unique items (``x-kubernetes-list-type: set``).
* `KpxModel`: the base model (unknown fields forbidden, camelCase names) that runs the class
  level `__rules__` and publishes them, together with every default, in its JSON schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, PydanticUndefined, core_schema, to_jsonable_python

X_VALIDATIONS = "x-kubernetes-validations"
X_LIST_TYPE = "x-kubernetes-list-type"

Reason = Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired"]

#: Error type of every failed `Rule`; its context may carry ``field_path``.
RULE_ERROR = "kpx_rule"


@dataclass(frozen=True)
class Rule:
    """One validation rule, written twice: in CEL for the apiserver and in Python for the rest.

    `check` receives the same value as CEL's ``self`` (a model instance for class rules) and
    returns True when the value is valid. `message_expression`, when set, is a CEL expression
    producing the message, and `render` its Python twin; `message` is the static fallback.
    `field_path` (CEL syntax, relative to ``self``, e.g. ``.ipvs.acknowledgeDeprecation``)
    names the field the error is reported on.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    message_expression: str | None = None
    render: Callable[[Any], str] | None = None
    field_path: str | None = None
    reason: Reason | None = None

    def schema(self) -> dict[str, str]:
        """This rule as an item of ``x-kubernetes-validations``."""
        out = {"rule": self.cel, "message": self.message}
        if self.message_expression is not None:
            out["messageExpression"] = self.message_expression
        if self.field_path is not None:
            out["fieldPath"] = self.field_path
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    def error(self, value: Any) -> PydanticCustomError:
        """The Python error for a value that failed `check`."""
        message = self.render(value) if self.render is not None else self.message
        context = {"field_path": self.field_path.lstrip(".")} if self.field_path else None
        # Braces in messages are literal text, not placeholders of the error template.
        return PydanticCustomError(
            RULE_ERROR, message.replace("{", "{{").replace("}", "}}"), context
        )


def run_rules(rules: Sequence[Rule], value: Any) -> None:
    """Raise the error of the first rule that `value` breaks."""
    for rule in rules:
        if not rule.check(value):
            raise rule.error(value)


def invalid(message: str, field_path: str | None = None) -> PydanticCustomError:
    """A validation error with a readable message, optionally located below the current field."""
    context = {"field_path": field_path} if field_path else None
    return PydanticCustomError(RULE_ERROR, message.replace("{", "{{").replace("}", "}}"), context)


def _rule_schemas(rules: Sequence[Rule]) -> list[dict[str, str]]:
    return [rule.schema() for rule in rules]


@dataclass(frozen=True, init=False)
class Cel:
    """Annotation: attach `Rule`s to a field type, e.g. ``Annotated[list[CIDR], Cel(rule)]``."""

    rules: tuple[Rule, ...]

    def __init__(self, *rules: Rule) -> None:
        object.__setattr__(self, "rules", rules)

    def _validate(self, value: Any) -> Any:
        run_rules(self.rules, value)
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = dict(handler(schema))
        out[X_VALIDATIONS] = [*out.get(X_VALIDATIONS, []), *_rule_schemas(self.rules)]
        return out


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("must carry a time zone (e.g. 2024-01-01T00:00:00Z)")
    return value.astimezone(UTC)


#: An RFC 3339 time, serialized like Kubernetes' metav1.Time (second precision, "Z").
Timestamp = Annotated[
    datetime,
    AfterValidator(_utc),
    PlainSerializer(lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ"), return_type=str, when_used="json"),
]


@dataclass(frozen=True)
class Text:
    """Annotation for ``str``: length and pattern limits, reported with `message`.

    The CRD gets ``maxLength``/``minLength``/``pattern``; Python checks the same limits (the
    pattern must match the whole string) and reports `message` when the pattern fails.
    """

    max_length: int
    message: str
    pattern: str | None = None
    min_length: int = 0
    _regex: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.pattern is not None:
            object.__setattr__(self, "_regex", re.compile(self.pattern))

    def matches(self, value: str) -> bool:
        """Whether `value` fits the pattern (always True without one)."""
        return self._regex is None or self._regex.fullmatch(value) is not None

    def _validate(self, value: str) -> str:
        if len(value) > self.max_length:
            raise invalid(f"must be at most {self.max_length} characters")
        if len(value) < self.min_length:
            raise invalid(
                "must not be empty"
                if self.min_length == 1
                else f"must be at least {self.min_length} characters"
            )
        if not self.matches(value):
            raise invalid(self.message)
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = dict(handler(schema))
        if self.min_length:
            out["minLength"] = self.min_length
        out["maxLength"] = self.max_length
        if self.pattern is not None:
            out["pattern"] = self.pattern
        return out


@dataclass(frozen=True)
class SetList:
    """Annotation for lists: items are unique (``x-kubernetes-list-type: set``)."""

    def _validate(self, value: list[Any]) -> list[Any]:
        seen: set[Any] = set()
        for index, item in enumerate(value):
            if item in seen:
                raise invalid(f"duplicate value {json.dumps(item)}", f"[{index}]")
            seen.add(item)
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = dict(handler(schema))
        out[X_LIST_TYPE] = "set"
        return out


def _model_schema_extra(schema: dict[str, Any], cls: type[Any]) -> None:
    """Publish a model's rules and every default (default factories included) in its schema."""
    properties: dict[str, Any] = schema.get("properties", {})
    for name, info in cls.model_fields.items():
        prop = properties.get(info.alias or name)
        if prop is None:
            continue
        factory = info.default_factory
        default = factory() if factory is not None else info.default
        if default is None or default is PydanticUndefined:
            prop.pop("default", None)
        else:
            prop["default"] = to_jsonable_python(default, by_alias=True, exclude_none=True)
    rules: Sequence[Rule] = getattr(cls, "__rules__", ())
    if rules:
        schema[X_VALIDATIONS] = _rule_schemas(rules)


class KpxModel(BaseModel):
    """Base of every API model: camelCase JSON names, unknown fields rejected, rules checked.

    Subclasses declare cross-field rules in ``__rules__``; they are checked after the fields
    validate, and published as the object's ``x-kubernetes-validations``.
    """

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        json_schema_extra=_model_schema_extra,
    )

    __rules__: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        run_rules(type(self).__rules__, self)
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the API's field names; unset optional fields are left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
