"""Namespace opt-out: which namespaces this agent does not proxy, and how the apiserver is
asked to leave their objects out of the agent's watches (pure functions)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kpx_api.proxysettings import NamespaceOptOut


def excluded_namespaces(
    optout: NamespaceOptOut, namespaces: Mapping[str, Mapping[str, str]]
) -> frozenset[str]:
    """The opted-out namespaces: those matching the selector, plus those named."""
    by_label = {ns for ns, labels in namespaces.items() if optout.opts_out(ns, dict(labels))}
    return frozenset(by_label) | frozenset(optout.namespaces)


def exclusion_field_selector(excluded: Iterable[str]) -> str:
    """A field selector that makes the apiserver leave out objects of these namespaces.

    Namespace names are DNS-1123 labels (validated by the apiserver, or by the configuration
    models for names given there), so they cannot contain the selector's separators.
    """
    return ",".join(f"metadata.namespace!={ns}" for ns in sorted(excluded))
