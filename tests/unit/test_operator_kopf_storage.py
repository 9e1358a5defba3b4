"""kopf's "last handled" state is a digest in status.kopf, never a copy of the spec."""

from __future__ import annotations

import json
from typing import Any

from kopf._cogs.structs import bodies, patches

from kpx_operator.cli import operator_settings
from kpx_operator.kopf_storage import DigestDiffBaseStorage

SPEC = {"mode": "nftables", "nodeSelector": {"kpx.dev/pool": "a"}}


def pxc(spec: dict[str, Any], status: dict[str, Any] | None = None) -> bodies.Body:
    return bodies.Body(
        {
            "apiVersion": "proxy.kpx.dev/v1alpha1",
            "kind": "ProxyConfiguration",
            "metadata": {"name": "default", "labels": {"team": "net"}},
            "spec": spec,
            "status": status or {},
        }
    )


def stored(storage: DigestDiffBaseStorage, body: bodies.Body) -> dict[str, Any]:
    patch = patches.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body, extra_fields=[]))
    return dict(patch)


def test_the_operator_uses_the_digest_storage() -> None:
    assert isinstance(operator_settings().persistence.diffbase_storage, DigestDiffBaseStorage)


def test_status_holds_a_digest_and_no_copy_of_the_spec() -> None:
    storage = DigestDiffBaseStorage()
    patch = stored(storage, pxc(SPEC))
    kopf_status = patch["status"]["kopf"]
    assert set(kopf_status) == {"last-handled-digest"}
    assert kopf_status["last-handled-digest"].startswith("sha256:")
    assert "nftables" not in json.dumps(patch)


def test_unchanged_is_no_diff_changed_is_a_diff_new_is_a_creation() -> None:
    storage = DigestDiffBaseStorage()
    digest = stored(storage, pxc(SPEC))["status"]["kopf"]
    same = pxc(SPEC, {"kopf": digest})
    assert storage.fetch(body=same) == storage.build(body=same, extra_fields=[("spec",)])
    changed = pxc({**SPEC, "mode": "iptables"}, {"kopf": digest})
    old, new = storage.fetch(body=changed), storage.build(body=changed, extra_fields=[])
    assert old == {} and new["spec"]["mode"] == "iptables"  # kopf sees the spec as changed
    assert storage.fetch(body=pxc(SPEC)) is None  # never handled: a creation


def test_the_former_copy_of_the_spec_is_removed_at_the_first_store() -> None:
    legacy = {"kopf": {"last-handled-configuration": json.dumps({"spec": SPEC})}}
    patch = stored(DigestDiffBaseStorage(), pxc(SPEC, legacy))
    assert patch["status"]["kopf"]["last-handled-configuration"] is None
