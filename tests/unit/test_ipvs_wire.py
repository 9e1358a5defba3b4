"""The ipvs backend's own encoding of its IPVS requests (wire.py) says what pyroute2's request
classes say: both decoded by pyroute2's IPVS message class, attribute for attribute."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from pyroute2.netlink.generic import ipvs as genl

from kpx_agent.backends.ipvs import kernel, wire
from kpx_agent.backends.ipvs.model import VirtualKey, VirtualServer

V4 = VirtualKey(4, "tcp", "10.96.0.10", 80)
V6 = VirtualKey(6, "udp", "fd00:96::10", 53)
SCTP = VirtualKey(4, "sctp", "10.96.0.11", 9)


def pyroute2_message(cmd: int, attrs: list[tuple[str, Any]]) -> bytes:
    msg = genl.ipvsmsg()
    msg["cmd"] = cmd
    msg["version"] = genl.GENL_VERSION
    msg["attrs"] = attrs
    msg["header"]["type"] = 30
    msg["header"]["flags"] = wire.NLM_F_REQUEST | wire.NLM_F_ACK
    msg["header"]["sequence_number"] = 7
    msg["header"]["pid"] = 0
    msg.encode()
    return bytes(msg.data)


def decoded(data: bytes) -> dict[str, Any]:
    msg = genl.ipvsmsg(data)
    msg.decode()
    out: dict[str, Any] = {
        "cmd": msg["cmd"],
        "version": msg["version"],
        "type": msg["header"]["type"],
        "flags": msg["header"]["flags"],
        "seq": msg["header"]["sequence_number"],
    }
    for name, nested in msg["attrs"]:
        for attr, value in nested["attrs"]:
            if attr.endswith("_FLAGS") and not attr.startswith("IPVS_DEST_ATTR_TUN"):
                value = (value["flags"], value["mask"])
            if attr.startswith("IPVS_DEST_ATTR_TUN") and value == 0:
                continue  # tunnel fields, zero: for tunnel forwarding only, not sent by wire
            out[f"{name}.{attr}"] = value
    return out


@pytest.mark.parametrize("key", [V4, V6, SCTP], ids=["v4", "v6", "sctp"])
@pytest.mark.parametrize("persistence", [0, 600])
def test_add_and_change_of_a_virtual_server_say_what_pyroute2_says(
    key: VirtualKey, persistence: int
) -> None:
    vs = VirtualServer(key, "wrr", persistence, frozenset())
    for cmd in (wire.NEW_SERVICE, wire.SET_SERVICE):
        ours = wire.message(30, 7, cmd, wire.service_attrs(key, vs))
        theirs = pyroute2_message(
            cmd, [("IPVS_CMD_ATTR_SERVICE", kernel._service(key, vs).dump_nla())]
        )
        assert decoded(ours) == decoded(theirs)


@pytest.mark.parametrize("key", [V4, V6], ids=["v4", "v6"])
def test_virtual_server_keys_and_real_servers_say_what_pyroute2_says(key: VirtualKey) -> None:
    address = "10.244.1.2" if key.family == 4 else "fd00:244:1::2"
    key_only = ("IPVS_CMD_ATTR_SERVICE", kernel._service(key).dump_key())
    ours = wire.message(30, 7, wire.DEL_SERVICE, wire.service_attrs(key))
    assert decoded(ours) == decoded(pyroute2_message(wire.DEL_SERVICE, [key_only]))
    for cmd, weight in ((wire.NEW_DEST, 1), (wire.SET_DEST, 0), (wire.DEL_DEST, 0)):
        ours = wire.message(
            30, 7, cmd, wire.service_attrs(key) + wire.dest_attrs(key.family, address, 8080, weight)
        )
        dest = ("IPVS_CMD_ATTR_DEST", kernel._dest(address, 8080, weight).dump_nla())
        theirs = decoded(pyroute2_message(cmd, [key_only, dest]))
        assert decoded(ours) == theirs
        assert theirs["IPVS_CMD_ATTR_DEST.IPVS_DEST_ATTR_FWD_METHOD"] == wire.FWD_NAT  # NAT


@pytest.mark.parametrize(("family", "address"), [(4, "10.96.0.10"), (6, "fd00:96::10")])
@pytest.mark.parametrize("add", [True, False])
def test_an_address_of_the_dummy_interface_as_rtnetlink_reads_it(
    family: int, address: str, add: bool
) -> None:
    from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

    msg = ifaddrmsg(wire.address_message(9, add, family, 42, address))
    msg.decode()
    assert msg["header"]["type"] == (wire.RTM_NEWADDR if add else wire.RTM_DELADDR)
    assert msg["header"]["sequence_number"] == 9
    assert msg["header"]["flags"] & wire.NLM_F_ACK
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    assert (msg["family"], msg["prefixlen"], msg["index"]) == (af, 32 if family == 4 else 128, 42)
    assert msg.get_attr("IFA_LOCAL") == address and msg.get_attr("IFA_ADDRESS") == address
