"""agent.py: a failing sync is reported as a Warning Event SyncFailed (the operator shows it in
status.modeSwitch), rate-limited: the sync retries every 1-30 s."""

from __future__ import annotations

from kpx_agent.sync.loop import brief_error, sync_failure_due


def test_the_first_failure_and_a_new_error_are_reported_at_once() -> None:
    assert sync_failure_due(None, "nft: Operation not permitted", 100.0)
    told = ("nft: Operation not permitted", 100.0)
    assert sync_failure_due(told, "nft: No such file or directory", 101.0)


def test_the_same_error_is_reported_again_only_after_the_interval() -> None:
    told = ("nft: Operation not permitted", 100.0)
    assert not sync_failure_due(told, "nft: Operation not permitted", 101.0, interval=60.0)
    assert not sync_failure_due(told, "nft: Operation not permitted", 159.9, interval=60.0)
    assert sync_failure_due(told, "nft: Operation not permitted", 160.0, interval=60.0)


NFT_REFUSED = """nft rejected the transaction (exit 1): /dev/stdin:1:1-17: Error: Could not \
process rule: Operation not permitted
add table ip kpx
^^^^^^^^^^^^^^^^^
/dev/stdin:2:17-19: Error: Could not process rule: Operation not permitted
delete table ip kpx
                ^^^
/dev/stdin:3:10-12: Error: Could not process rule: Operation not permitted
table ip kpx {
         ^^^
/dev/stdin:3:10-12: Error: Could not process rule: Operation not permitted
table ip kpx {
         ^^^"""


def test_the_event_carries_each_line_of_the_error_once() -> None:
    assert brief_error(NFT_REFUSED) == (
        "nft rejected the transaction (exit 1): Error: Could not process rule: Operation not "
        "permitted | add table ip kpx | Error: Could not process rule: Operation not permitted | "
        "delete table ip kpx | table ip kpx {"
    )
    assert brief_error("x" * 700, limit=20) == "x" * 17 + "..."
    assert brief_error("") == ""
