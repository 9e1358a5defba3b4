"""A kernel tool's input fed while it is still being made (`nft -f -`, `iptables-restore`):
the tool parses the first pieces on another core while the agent renders the rest.

Both tools commit only once they have read their whole input (nft at its end, iptables-restore
at the COMMIT line each script ends with). So when making a piece fails, the tool is killed
before its stdin is closed: an unfinished input never reaches the kernel. A tool that stops
reading (it refused a line and exited) stops the feeding at once; the caller gets its exit
status and what it wrote on stderr, kept in a file (not a pipe: no deadlock between our
writes and its output)."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ..base import BackendError

#: How much of the input is written at a time (a pipe's capacity).
WRITE_BYTES = 1 << 16


@dataclass(frozen=True)
class Fed:
    """How a fed tool ended."""

    status: int  # its exit status (negative: killed by that signal)
    message: str  # what it wrote on stderr, at most 2,000 characters
    whole: bool  # every piece was written (False: the tool stopped reading first)
    timed_out: bool = False  # killed after the timeout


def feed(argv: list[str], pieces: Iterable[str], timeout: float | None = None) -> Fed:
    """Run `argv` with the concatenated `pieces` on its stdin, written as they are made.
    BackendError when the tool cannot be run or written to; what making a piece raises is
    raised after the tool was killed. `timeout`: seconds after which the tool is killed."""
    with tempfile.TemporaryFile() as errors:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors
            )
        except FileNotFoundError as exc:
            raise BackendError(f"{argv[0]} is not installed") from exc
        except OSError as exc:  # no pid left (EAGAIN under pids.max), ENOSPC, ...
            raise BackendError(f"cannot run {argv[0]}: {exc}") from exc
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(timeout, expire) if timeout is not None else None
        if timer is not None:
            timer.start()
        try:
            try:
                whole = _write(proc, pieces)
            except OSError as exc:
                _kill(proc)
                raise BackendError(f"cannot write to {argv[0]}: {exc}") from exc
            except BaseException:
                _kill(proc)
                raise
            status = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
        errors.seek(0)
        message = errors.read().decode(errors="replace").strip()[:2000]
        return Fed(status, message, whole, expired.is_set())


def _write(proc: subprocess.Popen[bytes], pieces: Iterable[str]) -> bool:
    """Write the pieces, about WRITE_BYTES at a time, then close stdin; False when the tool
    stopped reading (stdin closed too). Anything else propagates with stdin still open."""
    stdin = proc.stdin
    assert stdin is not None
    batch: list[str] = []
    size = 0
    try:
        for piece in pieces:
            batch.append(piece)
            size += len(piece)
            if size >= WRITE_BYTES:
                stdin.write("".join(batch).encode())
                batch, size = [], 0
        stdin.write("".join(batch).encode())
    except BrokenPipeError:
        _close(proc)
        return False
    _close(proc)
    return True


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()  # before its stdin closes: an unfinished input must never commit
    proc.wait()
    _close(proc)


def _close(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
