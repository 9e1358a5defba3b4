"""The directory of the state API's unix socket: created 0750 when it does not exist, used as it
is when it does (the agent never changes the mode of a directory it did not create), refused when
it is shared.

Shared means another user could put a socket of their own at the socket's path (before the agent
starts, or while it is away) and serve a forged state to the backends: a directory owned by
another user than the agent's (or root), or a world-writable directory with the sticky bit (the
system's temporary directories: /tmp, /var/tmp, /dev/shm). A world-writable directory without it
is accepted: Kubernetes' emptyDir, which the operator mounts there in mode external, is 0777 and
private to the pod.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: The mode of a directory the agent creates: its group may look, not connect (the socket is 0600).
CREATED_MODE = 0o750


class SocketDirectoryError(ValueError):
    """The socket's directory cannot be used (the message says why)."""


def directory_problem(directory: Path, st: os.stat_result, uid: int) -> str | None:
    """Why the existing `directory` (its stat `st`) is not fit for the socket of an agent
    running as `uid`, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid not in (0, uid):
        return (
            f"{directory} is owned by uid {st.st_uid}, neither the agent's user ({uid}) nor "
            "root: its owner could replace the socket; use a directory of the agent's own"
        )
    if mode & stat.S_IWOTH and mode & stat.S_ISVTX:
        return (
            f"{directory} is a shared directory (mode {mode:o}: every user may create a socket "
            "there first); use a directory of its own, e.g. "
            f"{directory / 'kpx' / 'state.sock'}, which the agent creates 0{CREATED_MODE:o}"
        )
    return None


def _create(directory: Path) -> bool:
    """Create `directory` (and missing parents); True when this call created it."""
    try:
        directory.mkdir(mode=CREATED_MODE)
    except FileExistsError:
        return False
    except FileNotFoundError:
        directory.parent.mkdir(parents=True, exist_ok=True)
        return _create(directory)
    os.chmod(directory, CREATED_MODE)  # the umask may have narrowed it; only ours is changed
    return True


def prepare_socket_directory(directory: Path) -> None:
    """Create `directory` 0750 when it does not exist, else check that it is not shared (its
    mode is left as it is). Raises SocketDirectoryError."""
    if _create(directory):
        return
    try:
        st = directory.stat()
    except OSError as exc:
        raise SocketDirectoryError(f"{directory}: {exc.strerror}") from None
    problem = directory_problem(directory, st, os.geteuid())
    if problem is not None:
        raise SocketDirectoryError(problem)
