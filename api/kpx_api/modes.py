"""The proxy modes and the settings block of each (upstream KubeProxyConfiguration's)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final

from pydantic import Field

from kpx_api.durations import Duration, parse_duration
from kpx_api.networks import CIDR
from kpx_api.validation import KpxModel, Rule, SetList


class Mode(StrEnum):
    """Which dataplane the agents program."""

    NFTABLES = "nftables"
    IPTABLES = "iptables"
    IPVS = "ipvs"
    EXTERNAL = "external"


#: Modes a kernel backend of the agent programs.
KERNEL_BACKEND_MODES: Final[frozenset[Mode]] = frozenset({Mode.NFTABLES, Mode.IPTABLES, Mode.IPVS})
#: Modes with no kernel backend: the agent runs state-server-only (it computes the node-local
#: state and serves it on the state API, programming nothing) and the user's backend, deployed
#: as a sidecar from spec.external, programs the dataplane.
STATE_SERVER_ONLY_MODES: Final[frozenset[Mode]] = frozenset({Mode.EXTERNAL})


def state_server_only(mode: str) -> bool:
    """Whether the agent runs `mode` without a kernel backend (see STATE_SERVER_ONLY_MODES)."""
    return mode in STATE_SERVER_ONLY_MODES


#: The modes the node agent can run (a kernel backend, or state-server-only): the one gate.
#: The API accepts every Mode; the operator deploys agents only for these (another mode
#: reports Degraded, reason ModeNotImplemented, and deploys nothing) and the agent refuses the
#: others at start. kpx_agent.backends.REGISTRY lists exactly these (a unit test checks), so a
#: new backend is its registry entry plus its mode here.
MODES_WITH_BACKEND: Final[frozenset[Mode]] = KERNEL_BACKEND_MODES | STATE_SERVER_ONLY_MODES


def has_backend(mode: str) -> bool:
    """Whether the node agent can run `mode` (see MODES_WITH_BACKEND)."""
    return mode in MODES_WITH_BACKEND


def no_backend_message(mode: str) -> str:
    """Why a mode without a backend runs nothing (the operator's condition, the agent's exit)."""
    have = " and ".join(sorted(MODES_WITH_BACKEND))
    return (
        f"mode {mode} has no backend in the kpx agent yet, so no agent can run it: use mode "
        f"nftables (recommended) or another mode with a backend ({have})"
    )


class IPVSScheduler(StrEnum):
    """IPVS scheduling algorithm (ipvsadm's names)."""

    RR = "rr"
    WRR = "wrr"
    LC = "lc"
    WLC = "wlc"
    LBLC = "lblc"
    LBLCR = "lblcr"
    SH = "sh"
    DH = "dh"
    SED = "sed"
    NQ = "nq"
    MH = "mh"


SYNC_PERIOD_RULES: Final = (
    Rule(
        cel="duration(self.syncPeriod) > duration('0s')",
        message="syncPeriod must be greater than 0",
        check=lambda s: parse_duration(s.sync_period) > 0,
        field_path=".syncPeriod",
    ),
    Rule(
        cel="duration(self.minSyncPeriod) <= duration(self.syncPeriod)",
        message="minSyncPeriod must not be greater than syncPeriod",
        check=lambda s: parse_duration(s.min_sync_period) <= parse_duration(s.sync_period),
        field_path=".minSyncPeriod",
    ),
)

_SYNC_PERIOD = (
    "Longest time between two full resyncs of the rules (e.g. 30s, 1m); must be greater than 0."
)
_MIN_SYNC_PERIOD = (
    "Shortest time between two resyncs: changes arriving faster are batched. 0s resyncs on "
    "every change. Must not be greater than syncPeriod."
)
_MASQUERADE_BIT = (
    "Bit of the packet mark (fwmark) used to flag packets for SNAT, 0-31. Change it only if "
    "another component on the node uses bit 14."
)
_MASQUERADE_ALL = (
    "SNAT all traffic sent to Service cluster IPs, not only traffic from outside the cluster."
)


class NFTablesSettings(KpxModel):
    """Settings of the nftables mode (upstream KubeProxyNFTablesConfiguration)."""

    __rules__ = SYNC_PERIOD_RULES

    masquerade_bit: int = Field(default=14, ge=0, le=31, strict=True, description=_MASQUERADE_BIT)
    masquerade_all: bool = Field(default=False, strict=True, description=_MASQUERADE_ALL)
    localhost_node_ports: bool = Field(
        default=False,
        strict=True,
        description="Opt-in, beyond upstream's nftables mode: accept NodePort connections to "
        "127.0.0.1 (IPv4 only; sets the node's route_localnet and drops packets to "
        "127.0.0.0/8 from outside the node) when nodePortAddresses is empty or holds "
        "127.0.0.1, as iptables.localhostNodePorts does. A switch from mode iptables with "
        "localhost NodePorts in effect carries them over when this is true.",
    )
    sync_period: Duration = Field(default="30s", description=_SYNC_PERIOD)
    min_sync_period: Duration = Field(default="1s", description=_MIN_SYNC_PERIOD)


class IPTablesSettings(KpxModel):
    """Settings of the iptables mode (upstream KubeProxyIPTablesConfiguration)."""

    __rules__ = SYNC_PERIOD_RULES

    masquerade_bit: int = Field(default=14, ge=0, le=31, strict=True, description=_MASQUERADE_BIT)
    masquerade_all: bool = Field(default=False, strict=True, description=_MASQUERADE_ALL)
    localhost_node_ports: bool = Field(
        default=True,
        strict=True,
        description="Accept NodePort connections to 127.0.0.1 (IPv4 only; sets the node's "
        "route_localnet) when nodePortAddresses is empty or holds 127.0.0.1, as upstream. "
        "Set false to accept NodePorts on real node addresses only.",
    )
    sync_period: Duration = Field(default="30s", description=_SYNC_PERIOD)
    min_sync_period: Duration = Field(default="1s", description=_MIN_SYNC_PERIOD)


ACKNOWLEDGE_IPVS_MESSAGE: Final = (
    "mode ipvs is deprecated upstream: set spec.ipvs.acknowledgeDeprecation: true to use it "
    "anyway, or use mode nftables (recommended)"
)

_IPVS_TIMEOUT = "{} for IPVS connections (e.g. 900s); 0s leaves the kernel's value unchanged."


class IPVSSettings(KpxModel):
    """Settings of the ipvs mode (upstream KubeProxyIPVSConfiguration).

    The ipvs mode is deprecated upstream: it needs acknowledgeDeprecation: true.
    """

    __rules__ = SYNC_PERIOD_RULES

    acknowledge_deprecation: bool = Field(
        default=False,
        strict=True,
        description="Must be true to use mode ipvs, which is deprecated upstream in favour of "
        "nftables: the apiserver rejects mode ipvs otherwise.",
    )
    masquerade_bit: int = Field(
        default=14,
        ge=0,
        le=31,
        strict=True,
        description=_MASQUERADE_BIT + " (upstream's ipvs mode reads iptables.masqueradeBit).",
    )
    masquerade_all: bool = Field(
        default=False,
        strict=True,
        description=_MASQUERADE_ALL + " (upstream's ipvs mode reads iptables.masqueradeAll).",
    )
    scheduler: IPVSScheduler = Field(
        default=IPVSScheduler.RR,
        description="IPVS scheduler: rr (round robin), wrr (weighted rr), lc (least "
        "connection), wlc (weighted lc), lblc (locality-based lc), lblcr (lblc with "
        "replication), sh (source hashing), dh (destination hashing), sed (shortest expected "
        "delay), nq (never queue) or mh (maglev hashing).",
    )
    sync_period: Duration = Field(default="30s", description=_SYNC_PERIOD)
    min_sync_period: Duration = Field(default="0s", description=_MIN_SYNC_PERIOD)
    strict_arp: bool = Field(
        default=False,
        strict=True,
        alias="strictARP",
        description="Set arp_ignore=1 and arp_announce=2 so that nodes answer ARP only for "
        "addresses of the receiving interface (needed by some bare-metal load balancers).",
    )
    exclude_cidrs: Annotated[list[CIDR], Field(max_length=64), SetList()] = Field(
        default_factory=list,
        alias="excludeCIDRs",
        description="CIDRs whose IPVS virtual servers the agent must not touch when it cleans "
        "up stale rules.",
    )
    tcp_timeout: Duration = Field(
        default="0s", description=_IPVS_TIMEOUT.format("Idle timeout of established TCP")
    )
    tcp_fin_timeout: Duration = Field(
        default="0s", description=_IPVS_TIMEOUT.format("Timeout after a TCP FIN")
    )
    udp_timeout: Duration = Field(default="0s", description=_IPVS_TIMEOUT.format("Timeout of UDP"))


from kpx_api.external import ExternalSettings  # noqa: E402

ExternalSettings.__rules__ = SYNC_PERIOD_RULES

ModeSettings = NFTablesSettings | IPTablesSettings | IPVSSettings | ExternalSettings

#: The settings class of each mode.
SETTINGS_CLASS: Final[dict[Mode, type[ModeSettings]]] = {
    Mode.NFTABLES: NFTablesSettings,
    Mode.IPTABLES: IPTablesSettings,
    Mode.IPVS: IPVSSettings,
    Mode.EXTERNAL: ExternalSettings,
}
