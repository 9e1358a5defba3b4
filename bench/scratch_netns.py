"""Run a Python script in a network namespace of its own, made for the run and deleted after
(benchmarks that program the real kernel in-process: bench/sync_budget.py,
bench/memory_layers.py). Imports nothing heavy: the measured process imports its caller."""

from __future__ import annotations

import os
import subprocess
import uuid


def run_in_scratch_netns(prefix: str, argv: list[str]) -> str:
    """Run `argv` in a fresh netns named `prefix` + 6 hex digits; return its stdout."""
    ns = f"{prefix}{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv],
            check=True,
            capture_output=True,
            text=True,
            env=os.environ,
        ).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
