"""The cyclic garbage collector around the agent's bulk allocations."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No collection inside: for code that builds a great many containers at once (a big
    list's decode, the first full sync), where the collector's passes over them are pure
    cost. Nested uses, or a collector already off, leave it as they found it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
