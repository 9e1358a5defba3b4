"""CI's smoke of `make conformance`: a few of Kubernetes' own Services specs (e2e.test, built
from the pinned module) against kpx nftables on real kubelets, through the same runner, so the
harness cannot rot. The full run is `make conformance` (docs/conformance.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kpx_cluster import images
from kpx_cluster.conformance import run, specs

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


def test_services_specs_pass_against_kpx_nftables_on_real_kubelets(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("real nodes need root (namespaces, cgroups, mounts)", pytrace=False)
    if images.missing(directory=images.archives_dir()):
        pytest.fail("the kpx images are missing or stale: run `make image`", pytrace=False)
    suite = specs.SUITES["smoke"]
    selected, _ = specs.selected(suite, run.list_specs())
    assert len(selected) == 3, selected  # the specs exist in the pinned e2e.test
    row = run.run_target(run.Target("kpx", "nftables"), suite, selected, 3, tmp_path)
    assert row.outcome.failed == {}, (row.outcome.failed, tmp_path / "kpx-nftables" / "e2e.log")
    assert sorted(row.outcome.passed) == sorted(selected)
    assert row.conformance == (2, 2)
