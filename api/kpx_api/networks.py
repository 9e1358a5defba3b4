"""Network values: CIDRs, node port address lists and ``IP:port`` bind addresses."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Final

from pydantic import Field

from kpx_api.validation import Cel, Rule, SetList, Text

_PREFIX_LENGTH = r"/(0|[1-9][0-9]{0,2})"
CIDR_PATTERN: Final = rf"^[0-9a-fA-F:.]+{_PREFIX_LENGTH}$"
CIDR_MAX_LENGTH: Final = 64
CIDR_MESSAGE: Final = (
    "must be a CIDR such as 10.0.0.0/8 or fd00::/64, with no bits set after the prefix length"
)

PRIMARY: Final = "primary"

BIND_ADDRESS_PATTERN: Final = r"^(([0-9]{1,3}\.){3}[0-9]{1,3}|\[[0-9a-fA-F:.]+\]):[0-9]{1,5}$"
BIND_ADDRESS_MAX_LENGTH: Final = 64
BIND_ADDRESS_MESSAGE: Final = (
    "must be IP:port with the IPv6 address in brackets, e.g. 0.0.0.0:10256 or [::]:10256"
)


def parse_cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """The network of a CIDR accepted by this API; ValueError otherwise.

    Like the apiserver's CEL ``isCIDR``/``cidr().masked()``: no bits after the prefix length,
    no IPv4-mapped IPv6, no leading zeros, no zones.
    """
    if re.fullmatch(CIDR_PATTERN, text) is None:
        raise ValueError(f"invalid CIDR {text!r}")
    network = ipaddress.ip_network(text, strict=True)
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped:
        raise ValueError(f"IPv4-mapped IPv6 CIDR {text!r} is not allowed")
    return network


def is_cidr(text: str) -> bool:
    """Whether `text` is a CIDR this API accepts (see `parse_cidr`)."""
    try:
        parse_cidr(text)
    except ValueError:
        return False
    return True


def ip_family(cidr: str) -> int:
    """4 or 6: the IP family of a valid CIDR."""
    return parse_cidr(cidr).version


def parse_bind_address(text: str) -> tuple[str, int]:
    """``"[::1]:10249"`` -> ``("::1", 10249)``; ValueError unless IP:port with port 1-65535."""
    if re.fullmatch(BIND_ADDRESS_PATTERN, text) is None:
        raise ValueError(f"invalid bind address {text!r}")
    host, _, port_text = text.rpartition(":")
    bracketed = host.startswith("[")
    host = host.strip("[]")
    address = ipaddress.ip_address(host)
    if address.version != (6 if bracketed else 4):
        raise ValueError(f"invalid bind address {text!r}: IPv6 addresses go in brackets")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        raise ValueError(f"IPv4-mapped IPv6 address in {text!r} is not allowed")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"invalid port in {text!r}: must be 1-65535")
    return host, port


def _bind_host_ok(text: str) -> bool:
    host = text.rpartition(":")[0]
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return False
    return address.version == (6 if host.startswith("[") else 4)


def _bind_port_ok(text: str) -> bool:
    return 1 <= int(text.rpartition(":")[2]) <= 65535


_CIDR_CEL = "isCIDR(self) && cidr(self) == cidr(self).masked()"

CIDR_RULE: Final = Rule(cel=_CIDR_CEL, message=CIDR_MESSAGE, check=is_cidr)

#: One CIDR, e.g. ``10.244.0.0/16`` or ``fd00:10:244::/56``.
CIDR = Annotated[
    str,
    Text(max_length=CIDR_MAX_LENGTH, pattern=CIDR_PATTERN, message=CIDR_MESSAGE),
    Cel(CIDR_RULE),
]


def _one_per_family(cidrs: list[str]) -> bool:
    return len(cidrs) < 2 or ip_family(cidrs[0]) != ip_family(cidrs[1])


ONE_PER_FAMILY_RULE: Final = Rule(
    cel=(
        "size(self) < 2 || !isCIDR(self[0]) || !isCIDR(self[1]) || "
        "cidr(self[0]).ip().family() != cidr(self[1]).ip().family()"
    ),
    message="at most one CIDR per IP family: one IPv4 and one IPv6 CIDR",
    check=_one_per_family,
)

#: Up to two CIDRs, at most one per IP family (dual-stack clusters list one of each).
ClusterCIDRs = Annotated[list[CIDR], Field(max_length=2), SetList(), Cel(ONE_PER_FAMILY_RULE)]

NODE_PORT_ADDRESS_MESSAGE: Final = f'must be "{PRIMARY}" or a CIDR ({CIDR_MESSAGE})'
NodePortAddress = Annotated[
    str,
    Text(
        max_length=CIDR_MAX_LENGTH,
        pattern=rf"^({PRIMARY}|[0-9a-fA-F:.]+{_PREFIX_LENGTH})$",
        message=NODE_PORT_ADDRESS_MESSAGE,
    ),
    Cel(
        Rule(
            cel=f"self == '{PRIMARY}' || ({_CIDR_CEL})",
            message=NODE_PORT_ADDRESS_MESSAGE,
            check=lambda text: text == PRIMARY or is_cidr(text),
        )
    ),
]

PRIMARY_ALONE_RULE: Final = Rule(
    cel=f"!('{PRIMARY}' in self) || size(self) == 1",
    message=f'"{PRIMARY}" must be the only value when it is used',
    check=lambda items: PRIMARY not in items or len(items) == 1,
)

#: CIDRs of the node addresses that accept NodePort traffic, or the single value "primary".
NodePortAddresses = Annotated[
    list[NodePortAddress], Field(max_length=16), SetList(), Cel(PRIMARY_ALONE_RULE)
]

# CEL twins of parse_bind_address, guarded by the pattern so that a malformed value gets only the
# pattern's error, not CEL evaluation errors as well.
_MATCHES = f"self.matches(r'{BIND_ADDRESS_PATTERN}')"
_V6_HOST = "self.substring(1, self.lastIndexOf(']'))"
_V4_HOST = "self.substring(0, self.lastIndexOf(':'))"
_PORT = "int(self.substring(self.lastIndexOf(':') + 1))"

BIND_HOST_RULE: Final = Rule(
    cel=f"!{_MATCHES} || (self.startsWith('[') ? "
    f"isIP({_V6_HOST}) && ip({_V6_HOST}).family() == 6 : "
    f"isIP({_V4_HOST}) && ip({_V4_HOST}).family() == 4)",
    message="the address must be an IPv4 address, or an IPv6 address in brackets",
    check=_bind_host_ok,
)
BIND_PORT_RULE: Final = Rule(
    cel=f"!{_MATCHES} || ({_PORT} >= 1 && {_PORT} <= 65535)",
    message="the port must be from 1 to 65535",
    check=_bind_port_ok,
)

#: ``IP:port`` to listen on; IPv6 as ``[address]:port``.
BindAddress = Annotated[
    str,
    Text(
        max_length=BIND_ADDRESS_MAX_LENGTH,
        pattern=BIND_ADDRESS_PATTERN,
        message=BIND_ADDRESS_MESSAGE,
    ),
    Cel(BIND_HOST_RULE, BIND_PORT_RULE),
]
