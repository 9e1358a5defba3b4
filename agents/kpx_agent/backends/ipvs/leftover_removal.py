"""The I/O edge of removing what a kpx ipvs agent left on a node (an agent of another mode,
after its first verified sync: the mode's `remove_leftovers`): read kpx's helper tables, whether
kube-proxy's ipvs-mode chains are here (the removing agent's probe, `Handover`), the virtual
servers and kube-ipvs0's addresses; `leftovers.plan_cleanup` (pure) decides what is kpx's;
remove that. Upstream kube-proxy's IPVS state stays for the takeover path."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from ...model.types import IPNetwork
from ..base import Draining
from ..kernel.names import NFT_FAMILIES
from . import kernel
from .leftovers import TABLE, IpvsCleanup, KpxMarks, draining, parse_marks, plan_cleanup
from .model import VirtualKey

log = logging.getLogger(__name__)


def read_marks() -> KpxMarks:
    if shutil.which("nft") is None:
        return KpxMarks()
    listings: dict[str, str | None] = {}
    for family in NFT_FAMILIES.values():
        proc = subprocess.run(
            ["nft", "-j", "list", "table", family, TABLE],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        listings[family] = proc.stdout if proc.returncode == 0 else None
    return parse_marks(listings)


def _open_ipvs() -> Any:
    try:
        return kernel.Ipvs()
    except kernel.KernelError:
        return None  # no IPVS in this kernel: no virtual server can be left


def remove_kpx_ipvs_leftovers(
    exclude_cidrs: tuple[IPNetwork, ...],
    kube_proxy_ipvs_mode_here: Callable[[], bool],
    open_ipvs: Callable[[], Any] = _open_ipvs,
) -> IpvsCleanup:
    """Remove the virtual servers, kube-ipvs0 and helper tables a kpx ipvs agent made here
    (but those in `exclude_cidrs`); none of them when `kube_proxy_ipvs_mode_here()`."""
    marks = read_marks()
    if not marks.families:
        return plan_cleanup(marks, False, {}, ())
    ipvs = open_ipvs()
    try:
        servers: dict[VirtualKey, list[tuple[str, int]]] = {}
        connections: dict[VirtualKey, int] = {}
        if ipvs is not None:
            for key in list(ipvs.services()):
                reals = ipvs.real_servers(key)
                servers[key] = list(reals)
                connections[key] = sum(r.active for r in reals.values())
        decided = plan_cleanup(
            marks, kube_proxy_ipvs_mode_here(), servers, kernel.bound_addresses(), exclude_cidrs
        )
        now, later = draining(decided.virtual_servers, connections)
        for key in now:
            ipvs.delete_service(key)
        if ipvs is not None:
            ipvs.flush()  # deletions are queued requests: send them (KernelError names failures)
    finally:
        if ipvs is not None:
            ipvs.close()
    if later:
        log.info(
            "kpx ipvs mode's leftovers: removed %d virtual servers, %d still carry "
            "established connections (kept, with kube-ipvs0 and the kpx-ipvs tables)",
            len(now),
            len(later),
        )
        raise Draining(
            f"{len(later)} of kpx's IPVS virtual servers still carry established "
            f"connections ({connections[later[0]]} through {later[0]}, ...): kept until they end"
        )
    if decided.dummy:
        kernel.delete_dummy()
    for family in decided.tables:
        proc = subprocess.run(
            ["nft", "delete", "table", NFT_FAMILIES[family], TABLE],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"nft delete table {NFT_FAMILIES[family]} {TABLE}: {proc.stderr}")
    kept = len(servers) - len(decided.virtual_servers)
    log.info(
        "kpx ipvs mode's leftovers: removed %d virtual servers%s (%s); %d left to others",
        len(decided.virtual_servers),
        " and kube-ipvs0" if decided.dummy else "",
        decided.why,
        kept,
    )
    return decided
