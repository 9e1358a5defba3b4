"""What a programmed ruleset does for Service traffic, read back from its dump (pure: text in,
mappings out).

bench/compare.py dumps the kernel's ruleset of each system (`nft -j list ruleset`, or
`iptables-save`) and reduces it to the same shape whatever wrote it:

    (Service IP, protocol, port) -> {"endpoint IP:port", ...}

by following what a packet to the Service IP would meet: the `service-ips` verdict map (both
kpx's `ip kpx` table and upstream kube-proxy's `ip kube-proxy` table have one), then jumps,
gotos, verdict maps and DNAT statements (a literal address, an anonymous
`numgen ... map { ... }`, or kpx's named `endpoints-<n>` maps keyed by the Service's own key and a
bucket); or, for iptables, the `-d VIP -p P --dport N -j CHAIN` rules of the services chain
(`KUBE-SERVICES`, `KPX-SERVICES`) and every `-j DNAT --to-destination` reachable from CHAIN
(through KUBE-SVC-/KUBE-SEP- chains, or kpx's KPX-SVC- chains). Two systems whose mappings
are equal send every Service's traffic to the same endpoints (the probabilities of the random
choice are not compared).

No I/O here: tests/unit/test_bench_compare.py covers it on small inputs.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, str, int]  # (Service IP, protocol, port)
Mappings = dict[Key, frozenset[str]]

PROTOCOLS = {6: "tcp", 17: "udp", 132: "sctp"}
_TOKEN_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')
MAX_DEPTH = 8
_SERVICE_ELEM_RE = re.compile(
    r"(\d+\.\d+\.\d+\.\d+) \. (\w+) \. (\d+)"
    r'(?: comment "[^"]*")? : (?:goto|jump) (\S+?)[,\s}]'
)


@dataclass
class Readback:
    """Mappings of every Service key found, and the chain each key's entry jumps to."""

    mappings: Mappings = field(default_factory=dict)
    chains: dict[Key, str] = field(default_factory=dict)


# ---- iptables ----------------------------------------------------------------------------------


def tokenize(line: str) -> list[str]:
    """Split one iptables-save line into words; a "quoted comment" is one word, unquoted."""
    if '"' not in line:
        return line.split()
    return [
        t[1:-1].replace('\\"', '"') if t.startswith('"') and t.endswith('"') and len(t) > 1 else t
        for t in _TOKEN_RE.findall(line)
    ]


IptablesTables = dict[str, dict[str, list[list[str]]]]


def parse_iptables_save(text: str) -> IptablesTables:
    """table -> chain -> rules, each rule the words after `-A CHAIN`. Chains declared with
    `:CHAIN POLICY [..]` appear even when empty."""
    tables: IptablesTables = {}
    current: dict[str, list[list[str]]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], {})
        elif current is None or line == "COMMIT":
            continue
        elif line.startswith(":"):
            current.setdefault(line[1:].split()[0], [])
        elif line.startswith("-A "):
            words = tokenize(line)
            if len(words) >= 2:
                current.setdefault(words[1], []).append(words[2:])
    return tables


def _option(words: Sequence[str], *names: str) -> str | None:
    """The value after the first of `names` in `words` that is not negated with `!`."""
    for i, word in enumerate(words[:-1]):
        if word in names and (i == 0 or words[i - 1] != "!"):
            return words[i + 1]
    return None


def _target(words: Sequence[str]) -> str | None:
    return _option(words, "-j", "--jump", "-g", "--goto")


def _host(address: str) -> str:
    ip, _, plen = address.partition("/")
    return ip if plen in ("", "32", "128") else address


def iptables_readback(text: str, services_chain: str, table: str = "nat") -> Readback:
    """Service keys of `services_chain` and the DNAT destinations reachable from each."""
    chains = parse_iptables_save(text).get(table, {})
    memo: dict[str, frozenset[str]] = {}

    def resolve(chain: str, depth: int) -> frozenset[str]:
        if chain in memo:
            return memo[chain]
        found: set[str] = set()
        if depth <= MAX_DEPTH:
            for words in chains.get(chain, []):
                target = _target(words)
                if target == "DNAT":
                    dest = _option(words, "--to-destination")
                    if dest:
                        found.add(dest)
                elif target in chains:
                    found |= resolve(target, depth + 1)
        memo[chain] = frozenset(found)
        return memo[chain]

    out = Readback()
    for words in chains.get(services_chain, []):
        dest, proto, port = _option(words, "-d"), _option(words, "-p"), _option(words, "--dport")
        target = _target(words)
        if dest is None or proto is None or port is None or target not in chains:
            continue
        key = (_host(dest), proto, int(port))
        out.chains[key] = target
        out.mappings[key] = resolve(target, 0)
    return out


def iptables_stats(text: str) -> dict[str, int]:
    """Lines of the dump, and chains and rules in all its tables (built-in chains included)."""
    tables = parse_iptables_save(text)
    return {
        "lines": text.count("\n"),
        "chains": sum(len(chains) for chains in tables.values()),
        "rules": sum(len(rules) for chains in tables.values() for rules in chains.values()),
    }


# ---- nftables (the JSON of `nft -j list ruleset`) ----------------------------------------------


def _objects(ruleset: Mapping[str, Any] | str) -> list[dict[str, Any]]:
    data = json.loads(ruleset) if isinstance(ruleset, str) else ruleset
    return list(data.get("nftables", []))


def _value(item: Any) -> Any:
    """An element or key as written, without an `elem` wrapper (comments, timeouts)."""
    if isinstance(item, dict) and "elem" in item:
        return _value(item["elem"].get("val"))
    return item


def _key_tuple(item: Any) -> tuple[Any, ...]:
    item = _value(item)
    if isinstance(item, dict) and "concat" in item:
        return tuple(_norm(x) for x in item["concat"])
    return (_norm(item),)


def _norm(x: Any) -> Any:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    return str(x)


def _proto(x: Any) -> str:
    return PROTOCOLS.get(x, str(x)) if isinstance(x, int) else str(x)


def _endpoint(value: Any) -> str | None:
    parts = _key_tuple(value)
    if len(parts) == 2:
        return f"{parts[0]}:{parts[1]}"
    if len(parts) == 1 and isinstance(parts[0], str):
        return parts[0]
    return None


def _verdict_target(value: Any) -> str | None:
    value = _value(value)
    if isinstance(value, dict):
        for kind in ("goto", "jump"):
            if kind in value:
                return str(value[kind]["target"])
    return None


@dataclass
class _NftTable:
    chains: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)
    maps: dict[str, list[Any]] = field(default_factory=dict)  # name -> [[key, value], ...]


def _nft_table(ruleset: Mapping[str, Any] | str, family: str, table: str) -> _NftTable:
    out = _NftTable()
    for obj in _objects(ruleset):
        kind, body = next(iter(obj.items()))
        if not isinstance(body, dict) or body.get("family") != family:
            continue
        if body.get("table") != table:
            continue
        if kind == "chain":
            out.chains.setdefault(str(body["name"]), [])
        elif kind == "rule":
            out.chains.setdefault(str(body["chain"]), []).append(list(body.get("expr", [])))
        elif kind in ("map", "set"):
            out.maps[str(body["name"])] = list(body.get("elem", []))
    return out


def _numgen_mod(key: Any) -> tuple[list[Any], int] | None:
    """For a map key `a . b . c . numgen random mod N`: ([a, b, c], N)."""
    if not isinstance(key, dict) or "concat" not in key:
        return None
    parts = list(key["concat"])
    last = parts[-1] if parts else None
    if isinstance(last, dict) and "numgen" in last:
        return parts[:-1], int(last["numgen"]["mod"])
    return None


def nft_readback(
    ruleset: Mapping[str, Any] | str,
    table: str,
    family: str = "ip",
    service_map: str = "service-ips",
) -> Readback:
    """Service keys of `service_map` in table `family table` and the endpoints each reaches."""
    t = _nft_table(ruleset, family, table)
    named: dict[str, dict[tuple[Any, ...], Any]] = {
        name: {_key_tuple(e[0]): e[1] for e in elems if isinstance(e, list) and len(e) == 2}
        for name, elems in t.maps.items()
    }

    def resolve(chain: str, key: Key, depth: int) -> set[str]:
        found: set[str] = set()
        if depth > MAX_DEPTH:
            return found
        for rule in t.chains.get(chain, []):
            for stmt in rule:
                found |= statement(stmt, key, depth)
        return found

    def statement(stmt: dict[str, Any], key: Key, depth: int) -> set[str]:
        if "dnat" in stmt:
            return dnat(stmt["dnat"], key)
        target = _verdict_target(stmt)
        if target is not None:
            return resolve(target, key, depth + 1)
        if "vmap" in stmt:
            data = stmt["vmap"].get("data")
            found: set[str] = set()
            if isinstance(data, dict) and "set" in data:
                for _, verdict in data["set"]:
                    chain = _verdict_target(verdict)
                    if chain is not None:
                        found |= resolve(chain, key, depth + 1)
            return found
        return set()

    def dnat(spec: dict[str, Any], key: Key) -> set[str]:
        addr = spec.get("addr")
        if isinstance(addr, str):
            return {f"{addr}:{spec['port']}" if "port" in spec else addr}
        if not isinstance(addr, dict) or "map" not in addr:
            return set()
        data, map_key = addr["map"].get("data"), addr["map"].get("key")
        values: list[Any] = []
        if isinstance(data, dict) and "set" in data:
            values = [pair[1] for pair in data["set"]]
        elif isinstance(data, str) and data.startswith("@"):
            elems = named.get(data[1:], {})
            split = _numgen_mod(map_key)
            if split is not None:
                prefix, mod = split
                if len(prefix) == 3:  # daddr . l4proto . dport: the Service's own key
                    protos = (key[1], *(k for k, v in PROTOCOLS.items() if v == key[1]))
                    for b in range(mod):
                        for proto in protos:
                            if (key[0], proto, key[2], b) in elems:
                                values.append(elems[(key[0], proto, key[2], b)])
                                break
        return {ep for v in values if (ep := _endpoint(v)) is not None}

    out = Readback()
    for elem in t.maps.get(service_map, []):
        if not isinstance(elem, list) or len(elem) != 2:
            continue
        parts = _key_tuple(elem[0])
        chain = _verdict_target(elem[1])
        if len(parts) != 3 or chain is None:
            continue
        key = (str(parts[0]), _proto(parts[1]), int(parts[2]))
        out.chains[key] = chain
        out.mappings[key] = frozenset(resolve(chain, key, 0))
    return out


def _anonymous_elements(node: Any) -> int:
    """Elements of the anonymous sets and maps written inside a rule (`{ ... }`)."""
    if isinstance(node, list):
        return sum(_anonymous_elements(x) for x in node)
    if not isinstance(node, dict):
        return 0
    found = len(node["set"]) if isinstance(node.get("set"), list) else 0
    return found + sum(_anonymous_elements(v) for k, v in node.items() if k != "set")


def nft_stats(ruleset: Mapping[str, Any] | str) -> dict[str, int]:
    """Tables, chains, rules, named sets and maps, and elements in an `nft -j` dump.

    `elements` counts those of named sets and maps plus those of anonymous ones written inside
    rules (`anonymous_elements`): the kernel holds both as set elements."""
    counts = {
        "tables": 0,
        "chains": 0,
        "rules": 0,
        "sets_and_maps": 0,
        "elements": 0,
        "anonymous_elements": 0,
    }
    for obj in _objects(ruleset):
        kind, body = next(iter(obj.items()))
        if kind == "table":
            counts["tables"] += 1
        elif kind == "chain":
            counts["chains"] += 1
        elif kind == "rule":
            counts["rules"] += 1
            counts["anonymous_elements"] += _anonymous_elements(body.get("expr", []))
        elif kind in ("set", "map"):
            counts["sets_and_maps"] += 1
            counts["elements"] += len(body.get("elem", []))
    counts["elements"] += counts["anonymous_elements"]
    return counts


def service_map_chains(listing: str) -> dict[Key, str]:
    """`nft list map ... service-ips` text: key -> the chain its verdict goes to."""
    found: dict[Key, str] = {}
    for m in _SERVICE_ELEM_RE.finditer(listing):
        found[(m[1], m[2], int(m[3]))] = m[4]
    return found


# ---- comparing ---------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Two mappings compared on a set of keys."""

    compared: int = 0
    missing_left: list[Key] = field(default_factory=list)  # key absent from the left mapping
    missing_right: list[Key] = field(default_factory=list)
    different: list[Key] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.missing_left or self.missing_right or self.different)

    def summary(self) -> str:
        if self.equal:
            return f"equal on {self.compared:,} Service ports"
        return (
            f"DIFFERENT on {self.compared:,} Service ports: {len(self.missing_left)} missing "
            f"left, {len(self.missing_right)} missing right, {len(self.different)} with other "
            f"endpoints; e.g. {'; '.join(self.examples[:3])}"
        )


def compare(
    left: Mapping[Key, frozenset[str]],
    right: Mapping[Key, frozenset[str]],
    keys: Iterable[Key] | None = None,
    max_examples: int = 5,
) -> Comparison:
    """Compare two mappings on `keys` (default: every key of either)."""
    wanted = sorted(set(left) | set(right) if keys is None else set(keys))
    out = Comparison(compared=len(wanted))
    for key in wanted:
        a, b = left.get(key), right.get(key)
        if a is None and b is None:
            out.missing_left.append(key)
            out.missing_right.append(key)
            problem = "in neither"
        elif a is None:
            out.missing_left.append(key)
            problem = "missing left"
        elif b is None:
            out.missing_right.append(key)
            problem = "missing right"
        elif a != b:
            out.different.append(key)
            problem = f"left only {sorted(a - b)}, right only {sorted(b - a)}"
        else:
            continue
        if len(out.examples) < max_examples:
            out.examples.append(f"{key[0]}:{key[2]}/{key[1]} {problem}")
    return out


def sample_keys(keys: Iterable[Key], n: int, seed: int, always: Iterable[Key] = ()) -> list[Key]:
    """`n` keys picked at random (reproducibly), plus every key of `always`."""
    pool = sorted(set(keys))
    picked = set(random.Random(seed).sample(pool, min(n, len(pool))))
    return sorted(picked | set(always))
