"""The collector pause around bulk allocations (kpx_kube)."""

from __future__ import annotations

import asyncio
import gc

import pytest

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


async def _made_and_seen(seconds: float, seen: list[bool]) -> list[list[int]]:
    seen.append(gc.isenabled())
    made = [[] for _ in range(1_000)]
    await asyncio.sleep(seconds)
    seen.append(gc.isenabled())
    return made


def test_wait_paused_keeps_the_collector_off_for_a_short_wait_and_freezes_its_objects() -> None:
    gc.collect()
    before = gc.get_freeze_count()
    seen: list[bool] = []
    try:
        made = asyncio.run(collector.wait_paused(_made_and_seen(0.01, seen), 5.0, freeze=True))
        assert seen == [False, False]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()


def test_wait_paused_turns_the_collector_back_on_past_its_limit_and_still_waits() -> None:
    seen: list[bool] = []
    made = asyncio.run(collector.wait_paused(_made_and_seen(0.3, seen), 0.05))
    assert len(made) == 1_000  # the result, after the limit
    assert seen == [False, True]  # off at first, on again once the limit passed
    assert gc.isenabled()


def test_wait_paused_past_its_limit_freezes_what_came_after_when_the_wait_ends() -> None:
    async def late() -> list[list[int]]:
        await asyncio.sleep(0.2)
        return [[] for _ in range(1_000)]  # made past the limit, with the collector on

    try:
        made = asyncio.run(collector.wait_paused(late(), 0.05, freeze=True))
        # gc.get_objects() lists every generation but the frozen one
        tracked = {id(obj) for obj in gc.get_objects()}
        assert not tracked & {id(obj) for obj in made}
    finally:
        gc.unfreeze()


def test_wait_paused_cancelled_cancels_what_it_waits_for() -> None:
    async def main() -> bool:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        outer = asyncio.ensure_future(collector.wait_paused(inner, 5.0))
        await asyncio.sleep(0.01)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0.01)
        return inner.cancelled()  # (before asyncio.run cancels what is left at its end)

    assert asyncio.run(main())
    assert gc.isenabled()
