"""Errors from spawning the kernel tools (a missing binary, ENOSPC, EAGAIN under pids.max)
are failed syncs, never an agent exit: each kernel edge turns them into BackendError, the
proxier keeps the last good rules and retries. Conntrack cleanup (netlink, off the programming
path) logs and goes on: test_conntrack_netlink.py."""

from __future__ import annotations

import errno
import subprocess
from typing import Any

import pytest
from backend_samples import SETTINGS

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.iptables import kernel as ipt_kernel
from kpx_agent.backends.nftables import kernel as nft_kernel
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import Proxier
from kpx_api.proxysettings import NamespaceOptOut


def cannot_spawn(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.EAGAIN, "Resource temporarily unavailable")


def test_nft_that_cannot_be_spawned_is_a_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", cannot_spawn)
    monkeypatch.setattr(subprocess, "run", cannot_spawn)
    with pytest.raises(BackendError, match="Resource temporarily unavailable"):
        nft_kernel.run_script(["add table ip kpx\n"])
    with pytest.raises(BackendError, match="Resource temporarily unavailable"):
        nft_kernel.check_script(["add table ip kpx\n"])


def test_a_netlink_socket_that_cannot_be_made_is_a_backend_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_socket() -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(nft_kernel.nft_query, "query_socket", no_socket)
    with pytest.raises(BackendError, match="Too many open files"):
        nft_kernel.present_families()
    with pytest.raises(BackendError, match="Too many open files"):
        nft_kernel.our_tables()


def test_a_missing_nft_binary_is_a_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nft_kernel, "NFT", "/nonexistent/nft")
    with pytest.raises(BackendError, match="nft"):
        nft_kernel.run_script(["add table ip kpx\n"])


def test_iptables_restore_that_cannot_be_spawned_is_a_backend_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(subprocess, "run", cannot_spawn)
    monkeypatch.setattr(subprocess, "Popen", cannot_spawn)
    with pytest.raises(BackendError, match="Resource temporarily unavailable"):
        ipt_kernel.restore(4, "*nat\nCOMMIT\n")
    with pytest.raises(BackendError, match="Resource temporarily unavailable"):
        ipt_kernel.restore_pieces(4, ["*nat\n", "COMMIT\n"])


def test_a_streamed_restore_by_a_tool_that_is_missing_or_stops_reading_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`restore_pieces` (the full sync's streamed restore): a missing tool, and a tool that
    exits without reading its whole input, even with status 0, are failed syncs."""
    monkeypatch.setitem(ipt_kernel.n.RESTORE, 4, "/nonexistent/iptables-restore")
    with pytest.raises(BackendError, match="not installed"):
        ipt_kernel.restore_pieces(4, ["*nat\n", "COMMIT\n"])
    monkeypatch.setitem(ipt_kernel.n.RESTORE, 4, "true")  # exits 0, reads nothing
    big = ["-A KPX-X -j RETURN\n" * 10_000] * 20  # 4 MB: more than a pipe holds
    with pytest.raises(BackendError, match="stopped reading its input"):
        ipt_kernel.restore_pieces(4, ["*nat\n", *big, "COMMIT\n"])


def test_the_proxier_turns_it_into_a_failed_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    spec = {"clusterIPs": ["10.96.0.10"], "ports": [{"port": 80}]}
    state.upsert(SERVICES, {"metadata": {"namespace": "d", "name": "a"}, "spec": spec})
    proxier = Proxier(
        state, NftablesBackend(SETTINGS), "n1", NamespaceOptOut(), AgentMetrics(), SETTINGS
    )
    monkeypatch.setattr(subprocess, "Popen", cannot_spawn)
    monkeypatch.setattr(subprocess, "run", cannot_spawn)
    outcome = proxier.sync()
    assert not outcome.ok and "Resource temporarily unavailable" in outcome.error
    assert proxier.metrics.kpx_sync_failures.labels(proxier.backend.mode)._value.get() == 1
    assert proxier.sync().full  # retried, in full (both tools still fail: nothing ran)
