"""The iptables backend's only I/O: the iptables tools, run with argument lists.

`restore` feeds a script on stdin to `iptables-restore --noflush` (IPv4) or
`ip6tables-restore --noflush` (IPv6); each table in it is committed atomically. `-w 5` waits
for the xtables lock where there is one (the legacy flavour; the nf_tables flavour accepts and
ignores it).
"""

from __future__ import annotations

import functools
import logging
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from ..base import BackendError
from ..kernel.tool_input import feed
from ..nf_generation import read as read_generation
from ..route_localnet import ROUTE_LOCALNET_FILE as ROUTE_LOCALNET_FILE
from ..route_localnet import ensure_sysctl as ensure_sysctl
from . import names as n

log = logging.getLogger(__name__)
WAIT = ("-w", "5")
PROC_SYS = Path("/proc/sys")
TIMEOUT = 300.0  # seconds; a restore of a very large ruleset takes a while


def _run(
    argv: list[str], stdin: str | None = None, output: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a tool; its standard output is kept only with `output` (a restore's is discarded:
    the listing a script's `-S` prints, tens of MB on a large node)."""
    try:
        return subprocess.run(
            argv,
            input=stdin,
            stdout=subprocess.PIPE if output else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=TIMEOUT,
        )
    except FileNotFoundError as exc:
        raise BackendError(f"{argv[0]} is not installed") from exc
    except OSError as exc:  # no pid left (EAGAIN under pids.max), ENOSPC, ...
        raise BackendError(f"cannot run {argv[0]}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{argv[0]} did not finish within {TIMEOUT:.0f}s") from exc


def restore(family: int, script: str) -> None:
    """Apply `script` with (ip6)iptables-restore --noflush; raise BackendError on failure."""
    proc = _run([n.RESTORE[family], *WAIT, "--noflush"], script, output=False)
    if proc.returncode != 0:
        raise BackendError(
            f"{n.RESTORE[family]} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}"
        )


def restore_pieces(family: int, pieces: Iterable[str]) -> None:
    """`restore` of a script fed to the tool while it is being made (`kernel.tool_input`): the
    tool reads and parses the first pieces while the agent renders the next (a full sync's
    script at 10,000 Services is 16 MB, which iptables-restore takes 0.7 s to read:
    docs/benchmarks.md). Nothing is committed unless the whole script was read: if making a
    piece fails, the tool is killed before it reads a COMMIT; if the tool stops reading (it
    refused a line), the rest is not made and its error is raised."""
    tool = n.RESTORE[family]
    fed = feed([tool, *WAIT, "--noflush"], pieces, timeout=TIMEOUT)
    if fed.timed_out:
        raise BackendError(f"{tool} did not finish within {TIMEOUT:.0f}s")
    if fed.status != 0 or not fed.whole:
        said = fed.message or "it stopped reading its input"
        raise BackendError(f"{tool} failed ({fed.status}): {said}")


def restore_test(family: int, script: str) -> str | None:
    """Whether (ip6)iptables-restore accepts `script`, asked with `--test` (nothing is
    applied): None when it does, else its message."""
    proc = _run([n.RESTORE[family], *WAIT, "--noflush", "--test"], script, output=False)
    if proc.returncode == 0:
        return None
    return proc.stderr.strip()[:2000] or f"{n.RESTORE[family]} --test exited {proc.returncode}"


def save(family: int, table: str) -> str:
    """The output of (ip6)iptables-save for one table."""
    proc = _run([n.SAVE[family], "-t", table])
    if proc.returncode != 0:
        raise BackendError(
            f"{n.SAVE[family]} -t {table} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}"
        )
    return proc.stdout


def chain_exists(family: int, table: str, chain: str) -> bool:
    """Whether `chain` is in `table` (lists that one chain only)."""
    proc = _run([n.LIST[family], *WAIT, "-t", table, "-n", "-L", chain])
    return proc.returncode == 0


def rule_packets(family: int, table: str, chain: str, words: tuple[str, ...]) -> int:
    """The packet counters, summed, of the rules of `chain` whose listing has all `words`
    (`iptables -L -v -x`); 0 when the chain cannot be listed."""
    try:
        proc = _run([n.LIST[family], *WAIT, "-t", table, "-n", "-v", "-x", "-L", chain])
    except BackendError:
        return 0
    total = 0
    for line in proc.stdout.splitlines()[2:]:
        fields = line.split()
        if fields and fields[0].isdigit() and all(w in fields for w in words):
            total += int(fields[0])
    return total


def available(family: int) -> bool:
    """Whether this node has the tools for `family` at all."""
    return shutil.which(n.RESTORE[family]) is not None and shutil.which(n.SAVE[family]) is not None


# ROUTE_LOCALNET_FILE (net.ipv4.conf.all.route_localnet of the agent's network namespace) and
# ensure_sysctl are imported above from `backends.route_localnet`, shared with nftables mode.


@functools.cache
def nf_tables_flavour() -> bool:
    """Whether this node's iptables is the nf_tables flavour (`iptables -V` says so): its every
    restore is then an nftables transaction, which moves the ruleset's generation id."""
    try:
        proc = _run([n.LIST[4], "-V"])
    except BackendError:
        return False
    return "nf_tables" in proc.stdout


def nft_generation() -> int | None:
    """The nftables ruleset generation id (`backends.nf_generation`) where iptables is the
    nf_tables flavour; None where it is legacy (its changes do not move it) or the kernel
    cannot be asked."""
    if not nf_tables_flavour():
        return None
    try:
        return read_generation()
    except OSError as exc:
        log.debug("cannot read the ruleset generation: %s", exc)
        return None


class Kernel(Protocol):
    """Every iptables edge of the iptables backend, as one object: `NodeKernel` on a node,
    `fake.FakeIptables` in memory (`fake.IptScripts` records the scripts)."""

    def restore(self, family: int, script: str) -> None:
        """`iptables-restore --noflush`: one atomic change; BackendError when refused."""

    def restore_pieces(self, family: int, pieces: Iterable[str]) -> None:
        """`restore` of the script the pieces make, read while they are made (nothing
        applied unless every piece was made and the tool accepted the whole)."""

    def check(self, family: int, script: str) -> str | None:
        """`iptables-restore --test`: why the script would be refused (None: it would not)."""

    def save(self, family: int, table: str) -> str:
        """What `iptables-save` prints for the table."""

    def chain_exists(self, family: int, table: str, chain: str) -> bool:
        """Whether the chain is in the table."""

    def generation(self) -> int | None:
        """The nftables ruleset generation id where iptables is the nf_tables flavour; None
        where it is legacy or the kernel cannot be asked."""

    def nf_tables(self) -> bool:
        """Whether the tools are iptables' nf_tables flavour (else legacy)."""


class NodeKernel:
    """The node's iptables tools."""

    def restore(self, family: int, script: str) -> None:
        restore(family, script)

    def restore_pieces(self, family: int, pieces: Iterable[str]) -> None:
        restore_pieces(family, pieces)

    def check(self, family: int, script: str) -> str | None:
        return restore_test(family, script)

    def save(self, family: int, table: str) -> str:
        return save(family, table)

    def chain_exists(self, family: int, table: str, chain: str) -> bool:
        return chain_exists(family, table, chain)

    def generation(self) -> int | None:
        return nft_generation()

    def nf_tables(self) -> bool:
        return nf_tables_flavour()
