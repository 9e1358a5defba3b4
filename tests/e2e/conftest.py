"""Fixtures for end-to-end tests: one real local control plane per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kpx_cluster.controlplane import Cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A real etcd + kube-apiserver + controller-manager + scheduler, torn down at the end."""
    c = Cluster(name=f"e2e-{os.getpid()}")
    c.up()
    try:
        yield c
    finally:
        c.down()
