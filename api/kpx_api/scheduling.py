"""Where and how the agent DaemonSet runs: tolerations, resources, rollout pace."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from kpx_api.names import (
    LABEL_KEY_MESSAGE,
    LABEL_KEYS_CEL,
    LabelKey,
    LabelValue,
    is_label_key,
)
from kpx_api.validation import X_VALIDATIONS, Cel, KpxModel, Rule, Text


class TolerationOperator(StrEnum):
    """How a toleration matches a taint's value."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    """The effect of a taint that a toleration tolerates."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(KpxModel):
    """Lets the agent pods run on nodes with a matching taint (the Kubernetes Toleration)."""

    __rules__ = (
        Rule(
            cel="has(self.key) || self.operator == 'Exists'",
            message="operator must be Exists when key is empty (to tolerate every taint)",
            check=lambda t: t.key is not None or t.operator is TolerationOperator.EXISTS,
            field_path=".operator",
        ),
        Rule(
            cel="self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="value must be empty when operator is Exists",
            check=lambda t: t.operator is not TolerationOperator.EXISTS or not t.value,
            field_path=".value",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerationSeconds is only used with effect NoExecute",
            check=lambda t: t.toleration_seconds is None or t.effect is TaintEffect.NO_EXECUTE,
            field_path=".tolerationSeconds",
            reason="FieldValueForbidden",
        ),
    )

    key: LabelKey | None = Field(
        default=None,
        description="Taint key to tolerate; empty (with operator Exists) tolerates every taint.",
    )
    operator: TolerationOperator = Field(
        default=TolerationOperator.EQUAL,
        description="Equal: the taint's value must equal `value`; Exists: any value.",
    )
    value: LabelValue | None = Field(
        default=None, description="Taint value to match when operator is Equal."
    )
    effect: TaintEffect | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="With effect NoExecute: how long the pod stays bound after the taint "
        "appears; unset means forever.",
    )


# Resource quantities, without sign: 100m, 128Mi, 1.5, 2e3.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN: Final = rf"^{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"
QUANTITY_MESSAGE: Final = "must be a non-negative quantity such as 100m, 0.5, 128Mi or 1G"
_SUFFIXES: Final = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(rf"(?P<number>{_NUMBER})(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE].*)?")


def parse_quantity(text: str) -> Decimal:
    """The value of a resource quantity: ``parse_quantity("100m") == Decimal("0.1")``."""
    match = _QUANTITY.fullmatch(text)
    if match is None or re.fullmatch(QUANTITY_PATTERN, text) is None:
        raise ValueError(f"invalid quantity {text!r}")
    number = Decimal(match["number"])
    suffix = match["suffix"] or ""
    try:
        if suffix[:1] in ("e", "E"):
            return number * Decimal(10) ** Decimal(suffix[1:])
        return number * _SUFFIXES[suffix]
    except (InvalidOperation, KeyError) as exc:
        raise ValueError(f"invalid quantity {text!r}") from exc


Quantity = Annotated[str, Text(max_length=64, pattern=QUANTITY_PATTERN, message=QUANTITY_MESSAGE)]

_RESOURCE_KEYS_RULE = Rule(
    cel=LABEL_KEYS_CEL,
    message=f"every resource name {LABEL_KEY_MESSAGE}",
    check=lambda m: all(is_label_key(k) for k in m),
    render=lambda m: (
        f"resource name {next(k for k in m if not is_label_key(k))!r} is invalid: "
        f"it {LABEL_KEY_MESSAGE}"
    ),
)

#: Resource name (cpu, memory, ephemeral-storage, ...) -> quantity.
ResourceList = Annotated[dict[str, Quantity], Field(max_length=8), Cel(_RESOURCE_KEYS_RULE)]


def _requests_within_limits(res: ResourceRequirements) -> bool:
    return all(
        name not in res.limits or parse_quantity(value) <= parse_quantity(res.limits[name])
        for name, value in res.requests.items()
    )


def _first_excess(res: ResourceRequirements) -> str:
    name = next(
        n
        for n, v in res.requests.items()
        if n in res.limits and parse_quantity(v) > parse_quantity(res.limits[n])
    )
    return (
        f"requests.{name} ({res.requests[name]}) must not exceed limits.{name} ({res.limits[name]})"
    )


class ResourceRequirements(KpxModel):
    """Compute resources of the agent container."""

    __rules__ = (
        Rule(
            cel="self.requests.all(k, !(k in self.limits) || !isQuantity(self.requests[k]) || "
            "!isQuantity(self.limits[k]) || "
            "quantity(self.requests[k]).compareTo(quantity(self.limits[k])) <= 0)",
            message="every request must be less than or equal to the limit of the same resource",
            check=_requests_within_limits,
            render=_first_excess,
            field_path=".requests",
        ),
    )

    requests: ResourceList = Field(
        default_factory=dict,
        description="Resources the scheduler reserves for the agent, e.g. {cpu: 100m, "
        "memory: 64Mi}.",
    )
    limits: ResourceList = Field(
        default_factory=dict,
        description="Upper bounds of the resources the agent may use, e.g. {memory: 256Mi}.",
    )


#: The agent's resources when a ProxyConfiguration leaves them out. The limit is the agent's
#: measured peak at 10,000 Services x 10 endpoints (nftables, a full relist included: about
#: 255 MB; docs/benchmarks.md) with 50 % headroom; the requests are an idle agent's.
DEFAULT_AGENT_REQUESTS: Final = {"cpu": "50m", "memory": "64Mi"}
DEFAULT_AGENT_LIMITS: Final = {"memory": "384Mi"}


def default_agent_resources() -> ResourceRequirements:
    return ResourceRequirements(
        requests=dict(DEFAULT_AGENT_REQUESTS), limits=dict(DEFAULT_AGENT_LIMITS)
    )


PERCENT_PATTERN: Final = r"^(100|[1-9][0-9]?)%$"
MAX_UNAVAILABLE_MESSAGE: Final = (
    'must be a positive integer (a number of nodes) or a percentage from "1%" to "100%"'
)


def _is_int_or_percent(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, str) and re.fullmatch(PERCENT_PATTERN, value) is not None


INT_OR_PERCENT_RULE: Final = Rule(
    cel=f"type(self) == int ? self >= 1 : string(self).matches(r'{PERCENT_PATTERN}')",
    message=MAX_UNAVAILABLE_MESSAGE,
    check=_is_int_or_percent,
)


class _IntOrPercent:
    """Annotation: ``x-kubernetes-int-or-string`` holding a positive int or a percentage."""

    def _validate(self, value: Any) -> int | str:
        if not _is_int_or_percent(value):
            raise INT_OR_PERCENT_RULE.error(value)
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self._validate)

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            X_VALIDATIONS: [INT_OR_PERCENT_RULE.schema()],
        }


#: A positive number of nodes, or a percentage of them ("10%").
IntOrPercent = Annotated[int | str, _IntOrPercent()]


def resolve_int_or_percent(value: int | str, total: int) -> int:
    """Nodes meant by `value` out of `total`: percentages round up, and never below 1."""
    if isinstance(value, int):
        return value
    percent = int(value.rstrip("%"))
    return max(1, -(-total * percent // 100))
