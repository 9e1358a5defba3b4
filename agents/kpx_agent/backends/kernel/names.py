"""Every kernel object kpx owns by name (and the spelling of the nft family keywords), named
here once: the modes, their leftover removal and the conntrack edge import these constants,
and `tests/unit/test_kernel_names.py` checks no other product file spells the literals."""

from __future__ import annotations

#: nftables family keyword of each IP family.
NFT_FAMILIES: dict[int, str] = {4: "ip", 6: "ip6"}
#: NFPROTO_* (netlink's family number) of each nft family keyword a table may have.
NFPROTO_OF: dict[str, int] = {"inet": 1, NFT_FAMILIES[4]: 2, NFT_FAMILIES[6]: 10}
#: nft data type of an address, per IP family.
NFT_ADDR_TYPE: dict[int, str] = {4: "ipv4_addr", 6: "ipv6_addr"}
#: The nftables mode's table (one per family).
NFT_TABLE = "kpx"
#: The ipvs mode's helper nftables table (one per family): masquerade and drops IPVS cannot say.
IPVS_TABLE = "kpx-ipvs"
#: The ipvs mode's dummy interface, holding the addresses of its virtual servers (the name
#: upstream kube-proxy's ipvs mode uses too).
IPVS_DUMMY = "kube-ipvs0"
