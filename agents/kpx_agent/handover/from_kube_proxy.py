"""Taking a node over from upstream kube-proxy (spec.takeover.fromKubeProxy): the I/O edges.

* `kube_proxy_runs_here`: whether a Pod of the `kube-system/kube-proxy` DaemonSet still runs
  on this node (one namespaced list, `pods` in kube-system filtered by spec.nodeName; the
  agent's Role `kpx-agent-takeover` in kube-system grants `list pods` there and nothing else).
* `remove_kube_proxy_leftovers`: kube-proxy's iptables chains and jumps (nat, filter, mangle;
  IPv4 and IPv6; in each iptables variant installed - nf_tables and legacy - since either may
  hold them), its `ip`/`ip6 kube-proxy` nftables tables, its ipvs mode's ipsets (once the
  rules using them are gone), and optionally its IPVS virtual servers and kube-ipvs0. What is
  whose is decided by kube_proxy_leftovers.py (pure); this module only runs the tools, with
  argument lists, and netlink for the ipsets and to ask which nftables tables exist.

The agent calls the removal after its own first verified sync and only once no kube-proxy Pod runs
on the node (handover/make_before_break.py), so the two never remove each other's rules while both
run.
"""

from __future__ import annotations

import errno
import logging
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kpx_kube import Client
from kpx_kube.watch_events import decode_list

from ..backends.kernel.nft_query import tables_named
from . import kube_proxy_leftovers as plan

log = logging.getLogger(__name__)

KUBE_PROXY_NAMESPACE: Final = "kube-system"
KUBE_PROXY_DAEMONSET: Final = "kube-proxy"
TIMEOUT: Final = 120.0
#: (save, restore) tools per family and variant; plain names last (a node with one flavour).
_VARIANTS: Final = {
    4: (
        ("iptables-nft-save", "iptables-nft-restore"),
        ("iptables-legacy-save", "iptables-legacy-restore"),
        ("iptables-save", "iptables-restore"),
    ),
    6: (
        ("ip6tables-nft-save", "ip6tables-nft-restore"),
        ("ip6tables-legacy-save", "ip6tables-legacy-restore"),
        ("ip6tables-save", "ip6tables-restore"),
    ),
}


class TakeoverError(RuntimeError):
    """A tool failed; what it had removed stays removed, the rest is retried."""


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, check=False, timeout=TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TakeoverError(f"{argv[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise TakeoverError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()[:1000]}")
    return proc.stdout


def _variants(family: int) -> list[tuple[str, str]]:
    """The installed variants of `family`'s tools (the plain names only when no explicit
    variant is installed: they are one of the two)."""
    found = [
        pair for pair in _VARIANTS[family][:2] if shutil.which(pair[0]) and shutil.which(pair[1])
    ]
    if not found:
        plain = _VARIANTS[family][2]
        if shutil.which(plain[0]) and shutil.which(plain[1]):
            found = [plain]
    return found


def remove_iptables_leftovers() -> list[plan.TablePlan]:
    """Remove kube-proxy's chains and jumps in every family, variant and table."""
    done: list[plan.TablePlan] = []
    for family in (4, 6):
        for save, restore in _variants(family):
            for table in plan.TABLES:
                try:
                    text = _run([save, "-t", table])
                except TakeoverError as exc:  # that table cannot exist there (module absent)
                    log.debug("%s -t %s: %s", save, table, exc)
                    continue
                table_plan = plan.plan_table(table, text)
                script = table_plan.script()
                if script:
                    _run([restore, "-w", "5", "--noflush"], script)
                    log.info(
                        "removed kube-proxy's rules (%s): %s", restore, plan.describe([table_plan])
                    )
                done.append(table_plan)
    return done


def remove_nft_leftovers() -> list[str]:
    if shutil.which("nft") is None:
        return []
    try:  # asked over netlink: `nft list tables` loads the whole ruleset first
        present = tables_named(plan.NFT_TABLES)
    except OSError as exc:
        raise TakeoverError(f"cannot ask nf_tables for kube-proxy's tables: {exc}") from exc
    tables: list[str] = [t for t in plan.NFT_TABLES if t in present]
    if tables:
        _run(["nft", "-f", "-"], plan.nft_script(tables))
        log.info("removed kube-proxy's nftables tables: %s", ", ".join(tables))
    return tables


#: The kernel's answer to destroying an ipset that a rule still uses (IPSET_ERR_BUSY).
_IPSET_BUSY: Final = 4100


def remove_ipset_leftovers() -> list[str]:
    """Destroy kube-proxy's ipvs-mode ipsets (after its iptables rules, which use them, are
    gone); one that a rule of someone else's still uses stays, as such a chain does. Returns
    the names destroyed. A kernel without ipset support has none to destroy."""
    from pyroute2 import IPSet
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipset = IPSet()
    except (OSError, NetlinkError) as exc:
        log.debug("no ipset support here: %s", exc)
        return []
    destroyed: list[str] = []
    try:
        try:
            names = [str(m.get_attr("IPSET_ATTR_SETNAME")) for m in ipset.list()]
        except NetlinkError as exc:
            log.debug("ipset list: %s", exc)
            return []
        for name in plan.ipsets_to_destroy(names):
            try:
                ipset.destroy(name)
            except NetlinkError as exc:
                if exc.code == _IPSET_BUSY:
                    log.warning(
                        "kept kube-proxy's ipset %s: a rule of someone else's uses it", name
                    )
                    continue
                if exc.code == errno.ENOENT:
                    continue
                raise TakeoverError(f"ipset destroy {name}: {exc}") from exc
            destroyed.append(name)
    finally:
        ipset.close()
    if destroyed:
        log.info("removed kube-proxy's ipsets: %s", ", ".join(destroyed))
    return destroyed


def remove_ipvs_leftovers() -> None:
    """IPVS virtual servers and kube-ipvs0 (kube-proxy's ipvs mode owns every virtual server
    outside its excludeCIDRs and binds their addresses to kube-ipvs0): the ipvs backend's full
    cleanup, as `proxy-agent cleanup --mode ipvs`. Only this path removes them; another kpx
    mode's agent removes only what a kpx ipvs agent made (the ipvs mode's `remove_leftovers`)."""
    from ..backends import load

    load("ipvs").cleanup()


def kube_proxy_ipvs_mode_here() -> bool:
    """Whether a chain only kube-proxy's ipvs mode creates is on this node (nat or filter,
    IPv4 or IPv6, any iptables variant)."""
    for family in (4, 6):
        for save, _restore in _variants(family):
            for table in ("nat", "filter"):
                try:
                    text = _run([save, "-t", table])
                except TakeoverError as exc:
                    log.debug("%s -t %s: %s", save, table, exc)
                    continue
                if plan.ipvs_mode_chains(table, text):
                    return True
    return False


def remove_kube_proxy_leftovers(include_ipvs: bool) -> None:
    remove_iptables_leftovers()
    remove_nft_leftovers()
    remove_ipset_leftovers()
    if include_ipvs:
        remove_ipvs_leftovers()


def kube_proxy_pods(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Pure: the names of the Pods (of a node's kube-system Pods) that belong to the
    kube-proxy DaemonSet and have not finished. A terminating Pod still counts: its
    kube-proxy may still be programming."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        if not any(
            o.get("kind") == "DaemonSet" and o.get("name") == KUBE_PROXY_DAEMONSET for o in owners
        ):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        out.append(str(meta.get("name") or ""))
    return out


async def kube_proxy_runs_here(client: Client, node_name: str) -> bool:
    """Whether a kube-proxy DaemonSet Pod is (still) on `node_name`; raises on API errors."""
    data = await client.list(
        "pods",
        f"/api/v1/namespaces/{KUBE_PROXY_NAMESPACE}/pods",
        {"fieldSelector": f"spec.nodeName={node_name}"},
    )
    names = kube_proxy_pods(decode_list(data).items)
    if names:
        log.debug("kube-proxy still runs on %s: %s", node_name, ", ".join(names))
    return bool(names)
