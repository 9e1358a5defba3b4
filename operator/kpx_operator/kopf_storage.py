"""Where kopf keeps its bookkeeping on a ProxyConfiguration: small, in status.kopf.

kopf decides whether a change is an update by comparing the object with the "last handled"
state, which its stock storages keep as a copy of the whole spec (a JSON string that every
`kubectl get -o yaml` and every GitOps diff shows). The reconciler never reads that copy: it is
level-based and reads the spec itself. So only whether the spec changed matters, and a digest
says that: `status.kopf.last-handled-digest`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, cast

import kopf
from kopf._cogs.structs import bodies, dicts, patches  # kopf's own types for its storages

#: The field kopf's StatusDiffBaseStorage used: removed at the first store.
LEGACY_FIELD = ("status", "kopf", "last-handled-configuration")


def digest(essence: Any) -> str:
    encoded = json.dumps(essence, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(encoded.encode()).hexdigest()


class DigestDiffBaseStorage(kopf.StatusDiffBaseStorage):
    """The last handled state as a digest of kopf's essence of the object.

    `fetch` gives kopf the current essence when the digest matches (nothing changed), and an
    empty essence when it does not (everything changed: an update, which the reconciler
    handles from the spec as it is). `extra_fields` must be the fields of the handlers that
    name one (all under spec here), as kopf builds the essence it compares with them.
    """

    def __init__(
        self,
        *,
        field: str = "status.kopf.last-handled-digest",
        extra_fields: Iterable[str] = ("spec",),
    ) -> None:
        super().__init__(field=field)
        self._extra = [dicts.parse_field(f) for f in extra_fields]

    def fetch(self, *, body: bodies.Body) -> bodies.BodyEssence | None:
        stored = dicts.resolve(body, self.field, None)
        if stored is None:
            return None
        current = self.build(body=body, extra_fields=self._extra)
        if digest(current) == stored:
            return current
        return cast(bodies.BodyEssence, {})

    def store(
        self, *, body: bodies.Body, patch: patches.Patch, essence: bodies.BodyEssence
    ) -> None:
        dicts.ensure(patch, self.field, digest(essence))
        if dicts.resolve(body, LEGACY_FIELD, None) is not None:
            dicts.ensure(patch, LEGACY_FIELD, None)  # a merge patch: null removes it
