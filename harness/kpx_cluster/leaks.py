"""Find files that hold a secret: the check that a key given inline never reaches a disk."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path


def files_holding(needle: bytes, roots: Iterable[Path], since: float) -> list[Path]:
    """The regular files under `roots` written at or after `since` (a time.time() value) whose
    bytes contain `needle`. Older files cannot hold what a test wrote, so they are not read:
    a shared /tmp holds thousands of them."""
    found = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = Path(folder) / name
                try:
                    info = path.lstat()  # a symlink is not followed out of the roots
                    # one second of slack: some filesystems keep coarse modification times
                    if not stat.S_ISREG(info.st_mode) or info.st_mtime < since - 1:
                        continue
                    if needle in path.read_bytes():
                        found.append(path)
                except OSError:
                    continue
    return found
