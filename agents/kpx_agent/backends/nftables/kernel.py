"""The nftables backend's only I/O: `nft` run with an argument list and a script on stdin."""

from __future__ import annotations

import subprocess

from ..base import BackendError
from . import names as n

NFT = "nft"


def run_script(script: str) -> None:
    """Apply `script` as one atomic transaction (`nft -f -`); raise BackendError on failure."""
    proc = subprocess.run(
        [NFT, "-f", "-"], input=script, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BackendError(f"nft rejected the transaction: {proc.stderr.strip()[:2000]}")


def our_tables() -> set[str]:
    """Which of our tables exist, as 'family name' strings."""
    proc = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BackendError(f"nft list tables failed: {proc.stderr.strip()}")
    wanted = {f"{fam} {n.TABLE}" for fam in n.FAMILIES.values()}
    found = {line.removeprefix("table ").strip() for line in proc.stdout.splitlines()}
    return wanted & found


def delete_tables(tables: set[str]) -> None:
    if tables:
        run_script("".join(f"delete table {t}\n" for t in sorted(tables)))
