"""The collector pause around bulk allocations (kpx_kube)."""

from __future__ import annotations

import gc

from kpx_kube import collector


def test_paused_turns_the_collector_off_inside_and_back_on_after() -> None:
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # nested: leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_paused_leaves_a_collector_that_was_off_off() -> None:
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
