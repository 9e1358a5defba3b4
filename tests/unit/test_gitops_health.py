"""The Argo CD health check (examples/gitops/argocd/health.lua, run by lua5.4), kstatus (the
cli-utils checker, toolchain/kstatus) and the Flux CEL expressions (examples/gitops/flux) on
statuses the e2e phases do not reach: they must agree on each. tests/e2e/test_gitops_status.py
runs them on the real objects of each phase."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from gitops_health import argocd, health, lua_literal

Obj = dict[str, Any]


def pxc(generation: int = 2, **status: Any) -> Obj:
    obj: Obj = {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": "p", "generation": generation},
        "spec": {"mode": "nftables"},
    }
    if status:
        obj["status"] = status
    return obj


def c(type_: str, status: str, reason: str, message: str = "m") -> Obj:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


QUIET = [c("Reconciling", "False", "Reconciled"), c("Stalled", "False", "AsExpected")]
CASES = {
    "no status at all": (pxc(), ("Current", "Error", "Progressing")),
    "the CRD's default": (
        pxc(conditions=[c("Reconciling", "True", "NotYetSeen")]),
        ("InProgress", "InProgress", "Progressing"),
    ),
    "acted on an older generation": (
        pxc(observedGeneration=1, conditions=[c("Ready", "True", "AllAgentsReady"), *QUIET]),
        ("InProgress", "InProgress", "Progressing"),
    ),
    "ready": (
        pxc(observedGeneration=2, conditions=[c("Ready", "True", "AllAgentsReady"), *QUIET]),
        ("Current", "Current", "Healthy"),
    ),
    "no node selected": (
        pxc(observedGeneration=2, conditions=[c("Ready", "False", "NoMatchingNodes"), *QUIET]),
        ("InProgress", "InProgress", "Progressing"),
    ),
    "older side of a conflict": (
        pxc(
            observedGeneration=2,
            conditions=[
                c("Ready", "True", "AllAgentsReady"),
                c("Degraded", "True", "NodeConflict"),
                *QUIET,
            ],
        ),
        ("Current", "Current", "Healthy"),
    ),
    "switch held": (
        pxc(
            observedGeneration=2,
            conditions=[
                c("Ready", "True", "AllAgentsReady"),
                c("Reconciling", "False", "Stalled"),
                c("Stalled", "True", "SettingsNotCarriedOver", "set acceptDropped"),
            ],
        ),
        ("Failed", "Failed", "Degraded"),
    ),
    "retrying a failed pass": (
        pxc(
            observedGeneration=2,
            conditions=[
                c("Ready", "True", "AllAgentsReady"),
                c("Reconciling", "True", "ReconcileFailed"),
                c("Stalled", "False", "AsExpected"),
            ],
        ),
        ("InProgress", "InProgress", "Progressing"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kstatus_flux_and_argocd_agree(name: str) -> None:
    obj, expected = CASES[name]
    h = health(obj)
    assert (h.kstatus, h.cel, h.argocd) == expected


def test_argocd_says_why() -> None:
    obj, _ = CASES["switch held"]
    assert argocd(obj) == ("Degraded", "SettingsNotCarriedOver: set acceptDropped")
    assert argocd(CASES["ready"][0]) == ("Healthy", "AllAgentsReady: m")


def test_lua_literal_keeps_every_character() -> None:
    text = 'a "quoted" \\ back\nslash, tab\t and é'
    assert lua_literal({"k": [text, 1, True, None]}) == (
        '{["k"] = {"a \\034quoted\\034 \\092 back\\010slash, tab\\009 and \\195\\169", '
        "1, true, nil}}"
    )
    stalled = [c("Reconciling", "False", "Stalled"), c("Stalled", "True", "InvalidSpec", text)]
    obj = pxc(observedGeneration=2, conditions=stalled)
    assert argocd(obj) == ("Degraded", f"InvalidSpec: {text}")


def test_docs_show_the_shipped_snippets() -> None:
    """docs/gitops.md shows the Flux Kustomization and the argocd-cm snippet as shipped."""
    repo = Path(__file__).resolve().parents[2]
    doc = (repo / "docs" / "gitops.md").read_text()
    for name in ("flux/kustomization.yaml", "argocd/argocd-cm.yaml"):
        text = (repo / "examples" / "gitops" / name).read_text()
        body = text[text.index("apiVersion:") :]  # the comments above it stay in the file
        assert f"```yaml\n{body}```" in doc, f"docs/gitops.md does not show {name} as it is"
