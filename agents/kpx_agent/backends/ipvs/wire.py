"""IPVS generic-netlink requests as bytes: the few messages the backend sends (add, change and
delete a virtual server or a real server; add or delete an address of the dummy interface),
encoded with struct.

pyroute2 builds the same messages through its generic request classes, at about 13 ms each in
the emulated guest (a cold sync of 1,000 Services sends 11,000 of them); this encodes them in
microseconds. tests/unit/test_ipvs_wire.py decodes every kind with pyroute2's own IPVS message
class and compares it with the message pyroute2 builds for the same request, so the two agree
attribute for attribute. Reads (dumps) still go through pyroute2.

Attribute numbers and types: include/uapi/linux/ip_vs.h (and pyroute2's ipvsmsg).
"""

from __future__ import annotations

import socket
import struct
import sys

from .model import PROTOCOLS, VirtualKey, VirtualServer

NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
GENL_VERSION = 1
#: Commands.
NEW_SERVICE, SET_SERVICE, DEL_SERVICE = 1, 2, 3
NEW_DEST, SET_DEST, DEL_DEST = 5, 6, 7
#: IPVS_CMD_ATTR_*.
ATTR_SERVICE, ATTR_DEST = 1, 2
#: IPVS_SVC_ATTR_*.
SVC_AF, SVC_PROTOCOL, SVC_ADDR, SVC_PORT = 1, 2, 3, 4
SVC_SCHED_NAME, SVC_FLAGS, SVC_TIMEOUT, SVC_NETMASK = 6, 7, 8, 9
#: IPVS_DEST_ATTR_*.
DEST_ADDR, DEST_PORT, DEST_FWD_METHOD, DEST_WEIGHT = 1, 2, 3, 4
DEST_U_THRESH, DEST_L_THRESH, DEST_ADDR_FAMILY = 5, 6, 11
#: IP_VS_CONN_F_MASQ: NAT forwarding (pyroute2's IPVSDest defaults to 3, direct routing).
FWD_NAT = 0
#: IP_VS_SVC_F_PERSISTENT (session affinity ClientIP).
PERSISTENT = 0x0001
_AF = {4: socket.AF_INET, 6: socket.AF_INET6}
#: A full virtual server's netmask: all ones for IPv4; for IPv6 a prefix length (128) in a
#: host-order u32, as ipvsadm sends it (the kernel refuses a full IPv6 service without it).
_NETMASK = {4: b"\xff\xff\xff\xff", 6: (128).to_bytes(4, sys.byteorder)}
_HEADER = struct.Struct("=IHHIIBBH")  # nlmsghdr, then genlmsghdr (cmd, version, reserved)


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _u16(value: int) -> bytes:
    return struct.pack("=H", value)


def _u32(value: int) -> bytes:
    return struct.pack("=I", value)


def _be16(value: int) -> bytes:
    return struct.pack(">H", value)


def service_attrs(key: VirtualKey, vs: VirtualServer | None = None) -> bytes:
    """The virtual server: its key only, or (with `vs`) the full entry the kernel wants to add
    or change one."""
    out = (
        _attr(SVC_AF, _u16(_AF[key.family]))
        + _attr(SVC_PROTOCOL, _u16(PROTOCOLS[key.protocol]))
        + _attr(SVC_ADDR, socket.inet_pton(_AF[key.family], key.address))
        + _attr(SVC_PORT, _be16(key.port))
    )
    if vs is not None:
        flags = PERSISTENT if vs.persistence else 0
        out += (
            _attr(SVC_SCHED_NAME, vs.scheduler.encode() + b"\0")
            + _attr(SVC_FLAGS, struct.pack("=II", flags, 0xFFFF))
            + _attr(SVC_TIMEOUT, _u32(vs.persistence))
            + _attr(SVC_NETMASK, _NETMASK[key.family])
        )
    return _attr(ATTR_SERVICE, out)


def dest_attrs(family: int, address: str, port: int, weight: int) -> bytes:
    """A real server with NAT forwarding."""
    return _attr(
        ATTR_DEST,
        _attr(DEST_ADDR, socket.inet_pton(_AF[family], address))
        + _attr(DEST_ADDR_FAMILY, _u16(_AF[family]))
        + _attr(DEST_PORT, _be16(port))
        + _attr(DEST_FWD_METHOD, _u32(FWD_NAT))
        + _attr(DEST_WEIGHT, _u32(weight))
        + _attr(DEST_U_THRESH, _u32(0))
        + _attr(DEST_L_THRESH, _u32(0)),
    )


def message(family_id: int, seq: int, cmd: int, attrs: bytes) -> bytes:
    """One request (acked) to the IPVS generic-netlink family `family_id`."""
    header = _HEADER.pack(
        _HEADER.size + len(attrs),
        family_id,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        0,
        cmd,
        GENL_VERSION,
        0,
    )
    return header + attrs


# ---- addresses on the dummy interface (rtnetlink) ----------------------------------------------

RTM_NEWADDR, RTM_DELADDR = 20, 21
NLM_F_EXCL, NLM_F_CREATE = 0x200, 0x400
IFA_ADDRESS, IFA_LOCAL = 1, 2
_IFADDRMSG = struct.Struct("=IHHIIBBBBI")  # nlmsghdr, then family, prefixlen, flags, scope, index


def address_message(seq: int, add: bool, family: int, index: int, address: str) -> bytes:
    """Add (or delete) `address` /32 or /128 on interface `index`, scope global, acked."""
    packed = socket.inet_pton(_AF[family], address)
    attrs = _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed)
    kind = RTM_NEWADDR if add else RTM_DELADDR
    flags = NLM_F_REQUEST | NLM_F_ACK | (NLM_F_CREATE | NLM_F_EXCL if add else 0)
    prefix = 32 if family == 4 else 128
    header = _IFADDRMSG.pack(
        _IFADDRMSG.size + len(attrs), kind, flags, seq, 0, _AF[family], prefix, 0, 0, index
    )
    return header + attrs
