"""The iptables backend's rules as typed values, and their one serializer to restore lines.

A rule is its matches, in order, and one target, each from the small vocabulary below (what
the backend's chains use, and nothing else); its chain is where a chain map puts it
(`rules.PortRules`, `chain_book.ChainBook`). Matches and targets hold parsed values
(addresses, networks, `Protocol`s, ints, chain names from `names.py`) and never text from the
cluster; the one string that comes from it, a service port's name in a comment, is checked
here against the characters iptables takes unquoted or quoted without escapes.

`_text` is the only place that writes iptables syntax, and `rule_text` joins it into the
rule body after `-A CHAIN `, spelled as `iptables-save` prints it (a full sync recognises its
own jump rules by that text). Every value is serialized once, when it is made (`.text`):
every rule a sync makes is written (a full sync writes them all) or compared with the
record, and the text is what both need, so equality and hashing are the text's (equal text,
equal value). The values are plain slotted classes, not frozen dataclasses, because a full
sync at 10,000 Services makes about 100,000 of them and a frozen dataclass costs three times
as much to make; nothing changes them once made.
"""

from __future__ import annotations

import re
from functools import cache
from typing import ClassVar

from ...model.types import IPNetwork, Protocol, ip_version


class Statement:
    """A match or a target; `text` is its restore text, made once by `_text`."""

    __slots__ = ("text",)
    text: str

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r})"


# -- matches


class Source(Statement):
    """`-s address` (a host: `/32`, `/128`) or `-s network`; `! -s` negated."""

    __slots__ = ("address", "negate")

    def __init__(self, address: str | IPNetwork, negate: bool = False) -> None:
        self.address, self.negate = address, negate
        self.text = _text(self)


class Destination(Statement):
    """`-d address` or `-d network`; `! -d` negated."""

    __slots__ = ("address", "negate")

    def __init__(self, address: str | IPNetwork, negate: bool = False) -> None:
        self.address, self.negate = address, negate
        self.text = _text(self)


class InInterface(Statement):
    """`-i name` (a trailing `+` is a prefix match); `! -i` negated. The name is the
    validated one of the detectLocal settings."""

    __slots__ = ("name", "negate")

    def __init__(self, name: str, negate: bool = False) -> None:
        self.name, self.negate = name, negate
        self.text = _text(self)


class Proto(Statement):
    """`-p protocol`."""

    __slots__ = ("protocol",)

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        self.text = _text(self)


class DestinationPort(Statement):
    """`-p protocol -m protocol --dport port`."""

    __slots__ = ("port", "protocol")

    def __init__(self, protocol: Protocol, port: int) -> None:
        self.protocol, self.port = protocol, port
        self.text = _text(self)


class Comment(Statement):
    """`-m comment --comment text`, quoted unless iptables-save prints it bare."""

    __slots__ = ("comment",)

    def __init__(self, comment: str) -> None:
        if not comment or any(c in comment for c in "\"\\'\n"):
            raise ValueError(f"comment {comment!r} would need escaping")
        self.comment = comment
        self.text = _text(self)


class AddrType(Statement):
    """`-m addrtype --src-type LOCAL` / `--dst-type LOCAL`."""

    __slots__ = ("source",)
    SOURCE_LOCAL: ClassVar[AddrType]
    DESTINATION_LOCAL: ClassVar[AddrType]

    def __init__(self, source: bool) -> None:
        self.source = source
        self.text = _text(self)


class CtState(Statement):
    """`-m conntrack --ctstate A,B`; `! --ctstate` negated."""

    __slots__ = ("negate", "states")

    def __init__(self, states: tuple[str, ...], negate: bool = False) -> None:
        self.states, self.negate = states, negate
        self.text = _text(self)


class Mark(Statement):
    """`-m mark --mark mark/mark` (every bit of `mark` set); `! --mark` negated."""

    __slots__ = ("mark", "negate")

    def __init__(self, mark: int, negate: bool = False) -> None:
        self.mark, self.negate = mark, negate
        self.text = _text(self)


class Random(Statement):
    """`-m statistic --mode random --probability p`."""

    __slots__ = ("probability",)

    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.text = _text(self)


class Recent(Statement):
    """`-m recent --name list --set`, or with `seconds`, `--update --seconds s --reap`."""

    __slots__ = ("name", "seconds")

    def __init__(self, name: str, seconds: int = 0) -> None:
        self.name, self.seconds = name, seconds
        self.text = _text(self)


Match = (
    Source
    | Destination
    | InInterface
    | Proto
    | DestinationPort
    | Comment
    | AddrType
    | CtState
    | Mark
    | Random
    | Recent
)

# -- targets


class Verdict(Statement):
    """`-j ACCEPT`, `DROP`, `REJECT` or `RETURN`."""

    __slots__ = ("verdict",)
    ACCEPT: ClassVar[Verdict]
    DROP: ClassVar[Verdict]
    REJECT: ClassVar[Verdict]
    RETURN: ClassVar[Verdict]

    def __init__(self, verdict: str) -> None:
        if verdict not in ("ACCEPT", "DROP", "REJECT", "RETURN"):
            raise ValueError(f"not a verdict: {verdict!r}")
        self.verdict = verdict
        self.text = _text(self)


class Jump(Statement):
    """`-j CHAIN`: one of ours (the names in `names.py`)."""

    __slots__ = ("chain",)

    def __init__(self, chain: str) -> None:
        self.chain = chain
        self.text = _text(self)


class Dnat(Statement):
    """`-j DNAT --to-destination address:port`."""

    __slots__ = ("address", "port")

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.text = _text(self)


class MarkOr(Statement):
    """`-j MARK --or-mark mark`."""

    __slots__ = ("mark",)

    def __init__(self, mark: int) -> None:
        self.mark = mark
        self.text = _text(self)


class MarkXor(Statement):
    """`-j MARK --xor-mark mark`."""

    __slots__ = ("mark",)

    def __init__(self, mark: int) -> None:
        self.mark = mark
        self.text = _text(self)


class Masquerade(Statement):
    """`-j MASQUERADE --random-fully`."""

    __slots__ = ()

    def __init__(self) -> None:
        self.text = _text(self)


Target = Verdict | Jump | Dnat | MarkOr | MarkXor | Masquerade


class Rule:
    """One rule: matches, in order, and a target; `text` is its body after `-A CHAIN `."""

    __slots__ = ("matches", "target", "text")

    def __init__(self, matches: tuple[Match, ...], target: Target) -> None:
        self.matches = matches
        self.target = target
        self.text = rule_text(matches, target)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rule) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Rule({self.text!r})"


def rule(*matches: Match, target: Target) -> Rule:
    return Rule(matches, target)


# Statements many rules share, made once.
proto = cache(Proto)
jump = cache(Jump)


# -- the iptables-restore serializer

_BARE_COMMENT = re.compile(r"[A-Za-z0-9_-]+")  # what iptables-save prints without quotes


def _address(address: str | IPNetwork) -> str:
    if isinstance(address, str):  # an address (an endpoint's is a plain str): a host route
        return f"{address}/{128 if ip_version(address) == 6 else 32}"
    return str(address)


def _not(negate: bool) -> str:
    return "! " if negate else ""


def probability_text(probability: float) -> str:
    return f"{probability:0.10f}"


def _text(s: Statement) -> str:
    """The restore text of one match or target (the most frequent first)."""
    if isinstance(s, Dnat):
        a = s.address
        return f"-j DNAT --to-destination {f'[{a}]' if ip_version(a) == 6 else a}:{s.port}"
    if isinstance(s, Destination):
        return f"{_not(s.negate)}-d {_address(s.address)}"
    if isinstance(s, DestinationPort):
        p = s.protocol.value
        return f"-p {p} -m {p} --dport {s.port}"
    if isinstance(s, Comment):
        text = s.comment
        quoted = text if _BARE_COMMENT.fullmatch(text) else '"' + text + '"'
        return f"-m comment --comment {quoted}"
    if isinstance(s, Source):
        return f"{_not(s.negate)}-s {_address(s.address)}"
    if isinstance(s, Jump):
        return f"-j {s.chain}"
    if isinstance(s, Verdict):
        return f"-j {s.verdict}"
    if isinstance(s, Random):
        return f"-m statistic --mode random --probability {probability_text(s.probability)}"
    if isinstance(s, Proto):
        return f"-p {s.protocol.value}"
    if isinstance(s, Recent):
        if s.seconds:
            return f"-m recent --name {s.name} --update --seconds {s.seconds} --reap"
        return f"-m recent --name {s.name} --set"
    if isinstance(s, AddrType):
        return f"-m addrtype {'--src-type' if s.source else '--dst-type'} LOCAL"
    if isinstance(s, CtState):
        return f"-m conntrack {_not(s.negate)}--ctstate {','.join(s.states)}"
    if isinstance(s, Mark):
        return f"-m mark {_not(s.negate)}--mark {s.mark:#x}/{s.mark:#x}"
    if isinstance(s, InInterface):
        return f"{_not(s.negate)}-i {s.name}"
    if isinstance(s, MarkOr):
        return f"-j MARK --or-mark {s.mark:#x}"
    if isinstance(s, MarkXor):
        return f"-j MARK --xor-mark {s.mark:#x}"
    if isinstance(s, Masquerade):
        return "-j MASQUERADE --random-fully"
    raise TypeError(f"not a match or target: {type(s).__name__}")


def rule_text(matches: tuple[Match, ...], target: Target) -> str:
    """The rule body after `-A CHAIN `, as iptables-save prints it."""
    if not matches:
        return target.text
    return f"{' '.join([m.text for m in matches])} {target.text}"


# The constants of the vocabulary (made once the serializer exists).
AddrType.SOURCE_LOCAL = AddrType(source=True)
AddrType.DESTINATION_LOCAL = AddrType(source=False)
Verdict.ACCEPT, Verdict.DROP = Verdict("ACCEPT"), Verdict("DROP")
Verdict.REJECT, Verdict.RETURN = Verdict("REJECT"), Verdict("RETURN")
