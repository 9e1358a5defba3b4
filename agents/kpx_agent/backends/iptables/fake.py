"""A fake of the kernel's iptables state for the iptables backend, and a packet tracer.

`FakeIptables` holds each (family, table)'s chains, built-in ones included, and applies the
scripts the backend hands to `iptables-restore --noflush` as the tool does: one run is one
atomic table change; `:CHAIN` creates or flushes a chain; `-A`, `-I`, `-D` (the rule must be
there) and `-X` (the chain must exist and nobody may jump to it); `-S` (a listing) changes
nothing; at COMMIT every `-j` target must be a chain of the table or a built-in target.
`save` prints what iptables-save would (the backend's full sync reads it); `dump()` is a
canonical text of our chains.

`trace(packet)` walks a packet through the built-in chains (nat PREROUTING or OUTPUT, filter
INPUT/FORWARD/OUTPUT, nat POSTROUTING) over every random choice (`-m statistic`), and returns
the set of outcomes: verdict, DNAT target, masquerade.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Iterable

from ...model.types import Protocol
from ..base import BackendError
from ..kernel.packet_walk import Outcome, Packet, Walk, every_outcome
from .script import LIST_FIRST as LIST

BUILTIN = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
}
TARGETS = {"ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "MARK", "MASQUERADE"}


class FakeError(BackendError):
    """What iptables-restore would refuse; nothing of that run is applied."""


Table = dict[str, list[str]]


class FakeIptables:
    def __init__(self) -> None:
        self.tables: dict[tuple[int, str], Table] = {
            (family, table): {chain: [] for chain in chains}
            for family in (4, 6)
            for table, chains in BUILTIN.items()
        }
        self.runs = 0
        # nftables transactions, as iptables-nft makes them: one per table section of a run
        # that changes anything (what the generation id of an iptables-nft kernel counts).
        self.commits = 0
        # Text the kernel refuses in any rule (a poison rule): an address, a port, ...
        self.refuse: set[str] = set()
        # Families whose every run the tool fails (say, no ip6tables in this kernel).
        self.broken_families: set[int] = set()
        # Whether it plays iptables' nf_tables flavour (`nf_tables`; its generation id stays
        # None, as legacy's: a drift check reads the tables back each time).
        self.nf_tables_flavour = False

    # -- the backend's kernel (`kernel.Kernel`)

    def check(self, family: int, script: str) -> str | None:
        return self.restore_test(family, script)

    def generation(self) -> int | None:
        """None, as legacy iptables: its changes move no generation id (a drift check reads
        iptables-save each time)."""
        return None

    def nf_tables(self) -> bool:
        return self.nf_tables_flavour

    def restore_test(self, family: int, script: str) -> str | None:
        """iptables-restore --test: what `restore` would say, applying nothing."""
        tables, runs, commits = self.tables, self.runs, self.commits
        self.tables = {k: {c: list(r) for c, r in t.items()} for k, t in tables.items()}
        try:
            self.restore(family, script)
        except FakeError as exc:
            return str(exc)
        finally:
            self.tables, self.runs, self.commits = tables, runs, commits
        return None

    def restore_pieces(self, family: int, pieces: Iterable[str]) -> None:
        """`restore` of the script the pieces make (a piece that fails to be made applies
        nothing)."""
        self.restore(family, "".join(pieces))

    def restore(self, family: int, script: str) -> None:
        if family in self.broken_families:
            raise FakeError(f"IPv{family}: refused (EAFNOSUPPORT)")
        lines = [ln for ln in script.splitlines() if ln.strip() and not ln.startswith("#")]
        staged: dict[str, Table] = {}
        current: Table | None = None
        name = ""
        commits = 0
        changes = False
        for line in lines:
            if line.startswith("*"):
                name = line[1:]
                current = staged[name] = {
                    c: list(r) for c, r in self.tables[(family, name)].items()
                }
                changes = False
            elif current is None:
                raise FakeError(f"line outside a table: {line}")
            elif line == "COMMIT":
                _check_targets(name, current)
                current = None
                commits += changes
            elif line.startswith(":"):
                chain = line[1:].split()[0]
                current[chain] = []
                changes = True
            elif line == LIST:
                continue  # a listing of the table: nothing changes
            else:
                if any(word in line for word in self.refuse):
                    raise FakeError(f"{line}: refused (EINVAL)")
                self._edit(current, line)
                changes = True
        if current is not None:
            raise FakeError("no COMMIT")
        for table, chains in staged.items():
            self.tables[(family, table)] = chains
        self.runs += 1
        self.commits += commits

    @staticmethod
    def _edit(table: Table, line: str) -> None:
        op, chain, *rest = line.split(" ", 2)
        body = rest[0] if rest else ""
        if chain not in table:
            raise FakeError(f"{line}: no chain {chain}")
        rules = table[chain]
        if op in ("-A", "-I"):
            # Legacy iptables-restore loads a jump's target as it reads the line (iptables-nft
            # at the COMMIT): a chain declared further down is refused.
            target = _target(body)
            if target and target not in TARGETS and target not in table:
                raise FakeError(f"{line}: no chain {target} yet (Couldn't load target)")
        if op == "-A":
            rules.append(body)
        elif op == "-I":
            index, _, rule = body.partition(" ")
            rules.insert(int(index) - 1, rule)
        elif op == "-D":
            if body not in rules:
                raise FakeError(f"{line}: no such rule")
            rules.remove(body)
        elif op == "-X":
            if chain in BUILTIN.get("nat", ()) + BUILTIN.get("filter", ()):
                raise FakeError(f"{line}: a built-in chain")
            users = [c for c, rs in table.items() for r in rs if _target(r) == chain]
            if users:
                raise FakeError(f"{line}: still used by {users[0]}")
            if table[chain]:
                raise FakeError(f"{line}: not empty (EBUSY)")
            del table[chain]
        else:
            raise FakeError(f"unknown command {line}")

    def save(self, family: int, table: str) -> str:
        chains = self.tables[(family, table)]
        lines = [f"*{table}"]
        for chain in chains:
            policy = "ACCEPT" if chain in BUILTIN[table] else "-"
            lines.append(f":{chain} {policy} [0:0]")
        for chain, rules in chains.items():
            lines += [f"-A {chain} {rule}" for rule in rules]
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def chain_exists(self, family: int, table: str, chain: str) -> bool:
        return chain in self.tables[(family, table)]

    def flush(self) -> None:
        self.__init__()  # type: ignore[misc]

    def dump(self) -> str:
        out = []
        for (family, table), chains in sorted(self.tables.items()):
            out.append(f"*{table} v{family}")
            for chain in sorted(chains):
                out.append(f":{chain}")
                out += [f"  {rule}" for rule in chains[chain]]
        return "\n".join(out) + "\n"

    # -- the tracer

    def trace(self, packet: Packet) -> set[Outcome]:
        return every_outcome(lambda choices: _Walk(self, packet, choices))


def _target(rule: str) -> str:
    words = rule.split()
    return words[words.index("-j") + 1] if "-j" in words else ""


def _check_targets(name: str, table: Table) -> None:
    for chain, rules in table.items():
        for rule in rules:
            target = _target(rule)
            if target and target not in TARGETS and target not in table:
                raise FakeError(f"*{name} {chain}: -j {target}: no such chain")


class _Stop(Exception):
    def __init__(self, verdict: str) -> None:
        self.verdict = verdict


class _Walk(Walk):
    #: The built-in chains each hook runs, in priority order.
    HOOKS = {
        "prerouting": [("nat", "PREROUTING")],
        "input": [("filter", "INPUT")],
        "forward": [("filter", "FORWARD")],
        "output": [("nat", "OUTPUT"), ("filter", "OUTPUT")],
        "postrouting": [("nat", "POSTROUTING")],
    }

    def __init__(self, fake: FakeIptables, packet: Packet, choices: list[int]) -> None:
        super().__init__(packet, choices)
        self.fake = fake

    def hook(self, hook: str) -> str:
        for table, chain in self.HOOKS[hook]:
            verdict = self.builtin(table, chain)
            if verdict != "accept":
                return verdict
        return "accept"

    def builtin(self, table: str, chain: str) -> str:
        try:
            self.chain(table, chain)
        except _Stop as stop:
            return stop.verdict
        return "accept"

    def chain(self, table: str, chain: str) -> None:
        """Run a chain; returns at its end or on RETURN; _Stop ends the built-in chain."""
        rules = self.fake.tables[(self.packet.family, table)][chain]
        for rule in rules:
            target = self.rule(shlex.split(rule))
            if target is None:
                continue
            name, args = target
            if name == "RETURN":
                return
            if name in ("ACCEPT", "DNAT", "MASQUERADE"):
                if name == "DNAT":
                    host, _, port = args[args.index("--to-destination") + 1].rpartition(":")
                    self.dnat = (host.strip("[]"), int(port))
                    self.daddr, self.dport = host.strip("[]"), int(port)
                if name == "MASQUERADE":
                    self.masquerade = True
                raise _Stop("accept")
            if name in ("DROP", "REJECT"):
                raise _Stop(name.lower())
            if name == "MARK":
                mark = int(args[1], 16)
                self.mark = self.mark | mark if args[0] == "--or-mark" else self.mark ^ mark
                continue
            self.chain(table, name)

    def rule(self, words: list[str]) -> tuple[str, list[str]] | None:
        """None when the rule does not match; else its target and the target's options."""
        i = 0
        while i < len(words):
            negate = words[i] == "!"
            if negate:
                i += 1
            opt = words[i]
            if opt == "-j":
                return words[i + 1], words[i + 2 :]
            if opt in ("-s", "-d"):
                addr = self.packet.saddr if opt == "-s" else self.daddr
                hit = _in(addr, words[i + 1])
                i += 2
            elif opt == "-i":
                name = words[i + 1]
                iif = self.packet.iif
                hit = iif.startswith(name[:-1]) if name.endswith("+") else iif == name
                i += 2
            elif opt == "-p":
                hit = self.packet.protocol == Protocol(words[i + 1])
                i += 2
            elif opt == "-m":
                module = words[i + 1]
                i += 2
                if module in (
                    "tcp",
                    "udp",
                    "sctp",
                    "comment",
                    "recent",
                    "addrtype",
                    "conntrack",
                    "mark",
                    "statistic",
                ):
                    continue  # their options follow
                raise AssertionError(f"module {module}")
            elif opt == "--dport":
                hit = self.dport == int(words[i + 1])
                i += 2
            elif opt == "--comment":
                i += 2
                continue
            elif opt in ("--src-type", "--dst-type"):
                addr = self.packet.saddr if opt == "--src-type" else self.daddr
                hit = addr in self.packet.local_addresses
                i += 2
            elif opt == "--ctstate":
                states = set(words[i + 1].split(","))
                current = {"NEW"} | ({"DNAT"} if self.dnat else set())
                hit = bool(states & current)
                i += 2
            elif opt == "--mark":
                value, _, mask = words[i + 1].partition("/")
                hit = self.mark & int(mask, 16) == int(value, 16)
                i += 2
            elif opt == "--mode":
                i += 2
                continue
            elif opt == "--probability":
                hit = self.choose(2) == 0
                i += 2
            elif opt == "--name":
                i += 2
                continue
            elif opt == "--update":
                hit = False  # no recent entry in a fresh trace
                i += 1
            elif opt in ("--set", "--reap"):
                i += 1
                continue
            elif opt == "--seconds":
                i += 2
                continue
            else:
                raise AssertionError(f"the tracer does not know {opt!r} in {' '.join(words)}")
            if hit == negate:
                return None
        return None


def _in(addr: str, net: str) -> bool:
    return ipaddress.ip_address(addr) in ipaddress.ip_network(net, strict=False)


class IptScripts:
    """A `kernel.Kernel` that applies nothing and records each (family, script) restored
    (golden tests, benchmarks); `saved` is what iptables-save prints per (family, table)."""

    def __init__(
        self, saved: dict[tuple[int, str], str] | None = None, nf_tables: bool = False
    ) -> None:
        self.saved = saved or {}
        self.scripts: list[tuple[int, str]] = []
        self.nf_tables_flavour = nf_tables

    def restore(self, family: int, script: str) -> None:
        self.scripts.append((family, script))

    def restore_pieces(self, family: int, pieces: Iterable[str]) -> None:
        self.restore(family, "".join(pieces))

    def check(self, family: int, script: str) -> str | None:
        return None

    def save(self, family: int, table: str) -> str:
        return self.saved.get((family, table), "")

    def chain_exists(self, family: int, table: str, chain: str) -> bool:
        return False

    def generation(self) -> int | None:
        return None

    def nf_tables(self) -> bool:
        return self.nf_tables_flavour
