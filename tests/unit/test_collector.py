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


def test_paused_with_freeze_freezes_what_was_made_inside_before_the_collector_runs_again() -> None:
    gc.collect()
    before = gc.get_freeze_count()
    try:
        with collector.paused(freeze=True):
            made = [[] for _ in range(1_000)]
            assert gc.get_freeze_count() == before  # not before the block ends
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        assert gc.get_count()[0] < 100  # nothing left for the next pass to scan
    finally:
        gc.unfreeze()


def test_paused_with_freeze_freezes_however_the_block_ends_and_leaves_an_off_collector_off() -> (
    None
):
    gc.collect()
    before = gc.get_freeze_count()
    gc.disable()
    try:
        try:
            with collector.paused(freeze=True):
                made = [[] for _ in range(1_000)]
                raise RuntimeError("the block failed")
        except RuntimeError:
            pass
        assert not gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()
        gc.enable()
