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


# ---- node agent end-to-end fixtures (see agent_harness.py) --------------------------------------

from agent_harness import AgentEnv, Kube, build_agent_env  # noqa: E402


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Iterator[Kube]:
    """Kubernetes objects as dicts on the session's cluster (kpx_kube's client)."""
    kube = Kube(cluster)
    yield kube
    kube.close()


@pytest.fixture(scope="module")
def agent_env(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[AgentEnv]:
    """One Topology (n1, n2, backends b1/b2, a client pod on n1), the Node objects, and one
    agent on n1 in the mode named by the test module's AGENT_MODE (default nftables)."""
    if os.geteuid() != 0:
        pytest.fail("the agent environment needs root (network namespaces)", pytrace=False)
    mode = str(getattr(request.module, "AGENT_MODE", "nftables"))
    with build_agent_env(cluster, mode) as shared:
        yield shared


@pytest.fixture
def agent_ns(kube: Kube) -> Iterator[str]:
    """A fresh namespace `t-<6 hex>` for one test, deleted (without waiting) afterwards."""
    name = kube.create_namespace()
    try:
        yield name
    finally:
        kube.delete("namespace", name)
