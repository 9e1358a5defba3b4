"""Which kpx modes this node can run: checked by the agent at start, reported to the operator.

The checks touch nothing: `nft --check` has the kernel validate a test table (a base chain on a
hook) without committing it; the iptables tools and ipvsadm are looked up on PATH; IPVS counts
as present when /proc/net/ip_vs exists (ip_vs loaded) and as loadable when the running kernel's
module lists (/lib/modules/RELEASE/modules.dep, modules.builtin) name it. `decide` (pure) turns
those facts into one verdict per mode; the agent writes them into its node's ProxyNodeState
(status.preflight), which the operator reads for condition Preflight, and records them for
people as an Event `ModePreflight` on its own Pod (kpx_api.preflight: the format).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kpx_api.modes import Mode
from kpx_api.preflight import ModeCheck

log = logging.getLogger(__name__)

TEST_TABLE: Final = (
    "table inet kpx-preflight {\n"
    "  chain probe {\n    type filter hook input priority 0; policy accept;\n  }\n"
    "}\n"
)
IPTABLES_TOOLS: Final = ("iptables-save", "iptables-restore", "ip6tables-save", "ip6tables-restore")
_IP_VS = re.compile(r"(^|/)ip_vs\.ko")


@dataclass(frozen=True)
class NodeFacts:
    kernel: str = ""
    nft: str | None = None  # `nft --version`, None: not installed
    nft_check: str | None = None  # None: the kernel accepted the test table; else its error
    missing_iptables_tools: tuple[str, ...] = ()
    ip_vs_loaded: bool = False
    ip_vs_module: bool = False  # in modules.dep or modules.builtin of the running kernel
    ipvsadm: bool = False


def decide(facts: NodeFacts) -> list[ModeCheck]:
    """One verdict per mode with kernel rules (pure)."""
    out = []
    if facts.nft is None:
        out.append(ModeCheck(Mode.NFTABLES, False, "nft is not installed"))
    elif facts.nft_check is not None:
        out.append(
            ModeCheck(
                Mode.NFTABLES,
                False,
                f"the kernel refuses a test nftables table "
                f"(kernel {facts.kernel}): {facts.nft_check}",
            )
        )
    else:
        out.append(ModeCheck(Mode.NFTABLES, True, f"{facts.nft}, kernel {facts.kernel}"))
    if facts.missing_iptables_tools:
        missing = " ".join(facts.missing_iptables_tools)
        out.append(ModeCheck(Mode.IPTABLES, False, f"not installed: {missing}"))
    else:
        out.append(ModeCheck(Mode.IPTABLES, True, "iptables and ip6tables tools installed"))
    tool = "" if facts.ipvsadm else "; ipvsadm is not installed (needed for ipvs timeouts)"
    if facts.ip_vs_loaded:
        out.append(ModeCheck(Mode.IPVS, True, f"ip_vs loaded{tool}"))
    elif facts.ip_vs_module:
        out.append(
            ModeCheck(
                Mode.IPVS, True, f"ip_vs not loaded but available in kernel {facts.kernel}{tool}"
            )
        )
    else:
        out.append(
            ModeCheck(
                Mode.IPVS, False, f"ip_vs is neither loaded nor a module of kernel {facts.kernel}"
            )
        )
    return out


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, check=False, timeout=30
    )


def gather(
    run: Callable[[list[str], str | None], subprocess.CompletedProcess[str]] = _run,
    proc: Path = Path("/proc"),
    modules: Path = Path("/lib/modules"),
) -> NodeFacts:
    """The node's facts (the I/O edge)."""
    kernel = os.uname().release
    nft = nft_check = None
    if shutil.which("nft"):
        version = run(["nft", "--version"], None)
        nft = version.stdout.strip() or "nft"
        check = run(["nft", "--check", "-f", "-"], TEST_TABLE)
        if check.returncode != 0:
            nft_check = (check.stderr.strip() or f"exit status {check.returncode}")[:200]
    missing = tuple(t for t in IPTABLES_TOOLS if shutil.which(t) is None)
    module = False
    for name in ("modules.dep", "modules.builtin"):
        try:
            text = (modules / kernel / name).read_text()
        except OSError:
            continue
        module = module or any(_IP_VS.search(line) for line in text.splitlines())
    return NodeFacts(
        kernel=kernel,
        nft=nft,
        nft_check=nft_check,
        missing_iptables_tools=missing,
        ip_vs_loaded=(proc / "net/ip_vs").exists(),
        ip_vs_module=module,
        ipvsadm=shutil.which("ipvsadm") is not None,
    )


async def check() -> list[ModeCheck]:
    """Check once (in a thread: subprocesses): one verdict per mode."""
    checks = decide(await asyncio.to_thread(gather))
    for verdict in checks:
        log.info("preflight: %s", verdict.line())
    return checks
