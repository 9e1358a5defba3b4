"""Shared pytest fixtures: the root check for netns tests and a function-scoped `topology`.

Nothing here skips: a netns test run without root fails with a message saying so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent
for _src in ("api", "kube", "agents", "operator", "harness"):
    if (_REPO / _src).is_dir() and str(_REPO / _src) not in sys.path:
        sys.path.append(str(_REPO / _src))  # works without `make setup-python` too

from kpx_cluster.netns import Topology, leftovers  # noqa: E402

ROOT_MESSAGE = (
    "this test needs root (it creates network namespaces and nftables rules inside them); "
    "run pytest as root - netns tests are never skipped"
)


def require_root() -> None:
    """Fail (never skip) the current test when not running as root."""
    if os.geteuid() != 0:
        pytest.fail(ROOT_MESSAGE, pytrace=False)


@pytest.fixture(autouse=True)
def _root_for_netns_tests(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("netns") is not None:
        require_root()


@pytest.fixture
def topology() -> Iterator[Topology]:
    """A fresh Topology, cleaned up after the test; the teardown fails if anything leaked."""
    require_root()
    topo = Topology()
    try:
        yield topo
    finally:
        topo.cleanup()
    left = leftovers(topo.prefix)
    assert not left, f"topology {topo.prefix} leaked: {left}"
