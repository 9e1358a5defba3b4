"""Label maps and label selectors (the Kubernetes ``LabelSelector`` shape)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final

from pydantic import Field

from kpx_api.names import (
    LABEL_KEY_MESSAGE,
    LABEL_KEYS_CEL,
    LabelKey,
    LabelValue,
    is_label_key,
)
from kpx_api.validation import Cel, KpxModel, Rule

LABEL_MAP_MAX_PROPERTIES: Final = 32


def _bad_keys(labels: dict[str, str]) -> list[str]:
    return [key for key in labels if not is_label_key(key)]


LABEL_KEYS_RULE: Final = Rule(
    cel=LABEL_KEYS_CEL,
    message=f"every key {LABEL_KEY_MESSAGE}",
    check=lambda labels: not _bad_keys(labels),
    render=lambda labels: f"key {_bad_keys(labels)[0]!r} is invalid: it {LABEL_KEY_MESSAGE}",
)

#: A map of label keys to label values, e.g. a node selector.
LabelMap = Annotated[
    dict[str, LabelValue], Field(max_length=LABEL_MAP_MAX_PROPERTIES), Cel(LABEL_KEYS_RULE)
]


class SelectorOperator(StrEnum):
    """How a selector requirement relates a label's value to `values`."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


_WITH_VALUES = (SelectorOperator.IN, SelectorOperator.NOT_IN)


class LabelSelectorRequirement(KpxModel):
    """A requirement on one label: its key, an operator and, for In/NotIn, the values."""

    __rules__ = (
        Rule(
            cel="!(self.operator in ['In', 'NotIn']) || size(self.values) > 0",
            message="values must not be empty when operator is In or NotIn",
            check=lambda r: r.operator not in _WITH_VALUES or len(r.values) > 0,
            field_path=".values",
            reason="FieldValueRequired",
        ),
        Rule(
            cel="self.operator in ['In', 'NotIn'] || size(self.values) == 0",
            message="values must be empty when operator is Exists or DoesNotExist",
            check=lambda r: r.operator in _WITH_VALUES or len(r.values) == 0,
            field_path=".values",
            reason="FieldValueForbidden",
        ),
    )

    key: LabelKey = Field(description="The label key the requirement applies to.")
    operator: SelectorOperator = Field(
        description="In, NotIn (the label's value is / is not in `values`), Exists or "
        "DoesNotExist (the label is present / absent; `values` must then be empty)."
    )
    values: Annotated[list[LabelValue], Field(max_length=64)] = Field(
        default_factory=list,
        description="Label values; required for In and NotIn, empty for Exists and DoesNotExist.",
    )


class LabelSelector(KpxModel):
    """Selects objects by labels: all of `matchLabels` and all of `matchExpressions` must hold."""

    match_labels: LabelMap = Field(
        default_factory=dict,
        description="Labels that must all be present with exactly these values.",
    )
    match_expressions: Annotated[list[LabelSelectorRequirement], Field(max_length=16)] = Field(
        default_factory=list,
        description="Requirements that must all hold.",
    )

    def is_empty(self) -> bool:
        """An empty selector selects every object."""
        return not self.match_labels and not self.match_expressions

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether an object with these labels is selected."""
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator is SelectorOperator.IN and labels.get(req.key) not in req.values:
                return False
            if (
                req.operator is SelectorOperator.NOT_IN
                and present
                and labels[req.key] in req.values
            ):
                return False
            if req.operator is SelectorOperator.EXISTS and not present:
                return False
            if req.operator is SelectorOperator.DOES_NOT_EXIST and present:
                return False
        return True

    def as_query(self) -> str:
        """The selector in the API's ``labelSelector`` query syntax, e.g. ``a=b,c in (x,y),!d``."""
        parts = [f"{key}={value}" for key, value in sorted(self.match_labels.items())]
        for req in self.match_expressions:
            values = ",".join(sorted(req.values))
            if req.operator is SelectorOperator.IN:
                parts.append(f"{req.key} in ({values})")
            elif req.operator is SelectorOperator.NOT_IN:
                parts.append(f"{req.key} notin ({values})")
            elif req.operator is SelectorOperator.EXISTS:
                parts.append(req.key)
            else:
                parts.append(f"!{req.key}")
        return ",".join(parts)
