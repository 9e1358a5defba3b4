"""The nftables backend's only I/O: `nft` run with an argument list and a script on stdin."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterable
from typing import IO

from ..base import BackendError
from . import names as n

NFT = "nft"


def run_script(parts: Iterable[str]) -> None:
    """Apply the concatenated `parts` as one atomic transaction (`nft -f -`).

    The parts are written to nft's stdin as they are produced, so nft parses the start of a
    large transaction while the caller still renders the rest (two cores instead of one).
    nft commits only after reading end-of-file: if producing a part fails, nft is killed
    first, and nothing of the transaction reaches the kernel. Raises BackendError when nft
    rejects the transaction.
    """
    # nft writes its errors only after reading all input, but a file (not a pipe) for them
    # rules out any deadlock between our writes and its output.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [NFT, "-f", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors
        )
        assert proc.stdin is not None
        try:
            for part in parts:
                proc.stdin.write(part.encode())
        except BrokenPipeError:
            pass  # nft exited early; its status and message say why
        except BaseException:
            proc.kill()  # before stdin closes: an unfinished transaction must never commit
            proc.wait()
            _close(proc.stdin)
            raise
        _close(proc.stdin)
        status = proc.wait()
        if status != 0:
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()[:2000]
            raise BackendError(f"nft rejected the transaction (exit {status}): {message}")


def _close(stream: IO[bytes]) -> None:
    with contextlib.suppress(BrokenPipeError):
        stream.close()


def tables_present() -> bool:
    """Whether both of our tables are in the kernel, asked in nft's check mode (the kernel
    validates the batch and applies nothing). Any `nft list` command, even `list tables`,
    first loads every set element into nft's cache: 2 s of CPU at 10,000 Services; this is
    about 10 ms at any size."""
    script = "".join(f"flush chain {fam} {n.TABLE} {n.NAT_OUTPUT}\n" for fam in n.FAMILIES.values())
    proc = subprocess.run(
        [NFT, "--check", "-f", "-"], input=script, capture_output=True, text=True, check=False
    )
    return proc.returncode == 0


def our_tables() -> set[str]:
    """Which of our tables exist, as 'family name' strings (lists them: slow at scale, for
    cleanup only)."""
    proc = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BackendError(f"nft list tables failed: {proc.stderr.strip()}")
    wanted = {f"{fam} {n.TABLE}" for fam in n.FAMILIES.values()}
    found = {line.removeprefix("table ").strip() for line in proc.stdout.splitlines()}
    return wanted & found


def delete_tables(tables: set[str]) -> None:
    if tables:
        run_script([f"delete table {t}\n" for t in sorted(tables)])
