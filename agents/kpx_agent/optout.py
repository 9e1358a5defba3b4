"""Namespace opt-out: which namespaces this agent does not proxy (pure functions)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

OPT_OUT_LABEL = "networking.k8s.io/kube-proxy"
OPT_OUT_VALUE = "disabled"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        raise ValueError(f"unknown label selector operator {self.operator!r}")


@dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes LabelSelector. An empty selector matches nothing here (no opt-out)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if not self.match_labels and not self.match_expressions:
            return False
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions
        )


DEFAULT_SELECTOR = LabelSelector(match_labels=((OPT_OUT_LABEL, OPT_OUT_VALUE),))


@dataclass(frozen=True)
class OptOut:
    """Namespaces opted out by name, and by a label selector on the Namespace."""

    names: frozenset[str] = frozenset()
    selector: LabelSelector = field(default_factory=lambda: DEFAULT_SELECTOR)

    def excluded(self, namespaces: Mapping[str, Mapping[str, str]]) -> frozenset[str]:
        """The opted-out namespaces among `namespaces` (name -> labels), plus the named ones."""
        by_label = {ns for ns, labels in namespaces.items() if self.selector.matches(labels)}
        return frozenset(by_label) | self.names


def exclusion_field_selector(excluded: Iterable[str]) -> str:
    """A field selector that makes the apiserver leave out objects of these namespaces."""
    return ",".join(f"metadata.namespace!={ns}" for ns in sorted(excluded))
