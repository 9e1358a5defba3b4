"""Fixtures for end-to-end tests: one real local control plane per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import guest_background
import pytest

from kpx_cluster.controlplane import Cluster

# ---- the IPVS guest's kernel tests, beside the rest of the session (guest_background.py) ----


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_ipvs_in_vm.py's tests go last: the guest's kernel tests run in the background
    meanwhile."""
    guest_tests = [i for i in items if i.nodeid.startswith(guest_background.MODULE)]
    if guest_tests:
        items[:] = [i for i in items if not i.nodeid.startswith(guest_background.MODULE)]
        items += guest_tests


def pytest_collection_finish(session: pytest.Session) -> None:
    selected = any(i.nodeid == guest_background.KERNEL_TEST for i in session.items)
    if selected and guest_background.cannot_run() is None and not session.config.option.collectonly:
        guest_background.current = guest_background.BackgroundRun()
        guest_background.current.start()


def pytest_sessionfinish() -> None:
    if guest_background.current is not None:
        guest_background.current.stop()
        guest_background.current = None


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
