"""Which `[sig-network]` specs of Kubernetes' e2e suite `make conformance` runs, and why the
others do not run (pure data and regexes; `e2e.test --list-tests` names every spec).

A suite is a focus (specs to run) minus skip groups, each with the reason a reader of the table
sees. `proxy` is what the issue calls the specs that exercise a service proxy: every
`[sig-network] ... [Conformance]` spec, and the Services, EndpointSlice, Networking granular
Services, Conntrack, KubeProxy, session affinity, traffic policy and distribution, and
dual-stack specs. `conformance` is the 47 Conformance specs alone; `smoke` is the few Services
specs CI runs so the harness cannot rot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class SkipGroup:
    name: str
    pattern: str  # a regex over the full spec text
    reason: str


SKIPS: Final = (
    SkipGroup(
        "cloud load balancers",
        r"LoadBalancer",
        "needs a cloud provider's load balancer (the skeleton provider has none)",
    ),
    SkipGroup(
        "disruptive",
        r"\[Disruptive\]",
        "restarts the apiserver or the proxy over SSH to the nodes (the skeleton provider "
        "has no SSH); `make chaos` covers restarts of kpx",
    ),
    SkipGroup(
        "serial",
        r"\[Serial\]",
        "needs the whole cluster to itself (SCTP host ports, DNS upstream forwarding, "
        "static-pod kube-proxy migration); the ones left are not the proxy's",
    ),
    SkipGroup("sctp", r"SCTP", "this machine's kernel has no SCTP module"),
    SkipGroup(
        "internet",
        r"Internet connection|Feature:Networking-(IPv4|IPv6|DNS)",
        "needs the internet: no packet of the cluster leaves this machine",
    ),
    SkipGroup(
        "performance",
        r"Feature:Networking-Performance|Feature:PerformanceDNS",
        "performance runs (iperf2, DNS at scale), not correctness; bench/ measures kpx",
    ),
    SkipGroup(
        "nfacct",
        r"Feature:KubeProxyNFAcct",
        "upstream's alpha nfacct counter for localhost NodePorts; kpx has no such metric",
    ),
)

#: the specs that exercise a service proxy (with [Conformance], the `proxy` suite's focus)
PROXY_GROUPS: Final = (
    r"\[sig-network\].*\[Conformance\]",
    r"\[sig-network\] Services ",
    r"\[sig-network\] Service endpoints",
    r"\[sig-network\] Service CIDRs",
    r"\[sig-network\] EndpointSlice",
    r"\[sig-network\] Networking Granular Checks: Services",
    r"\[sig-network\] Networking should check kube-proxy urls",
    r"\[sig-network\] Conntrack",
    r"\[sig-network\] KubeProxy",
    r"\[sig-network\] Traffic Distribution",
    r"\[sig-network\] Topology Hints",
    r"\[sig-network\] Connectivity Pod Lifecycle",
    r"\[sig-network\] NoSNAT",
    r"\[sig-network\] \[Feature:IPv6DualStack\]",
)


@dataclass(frozen=True)
class Suite:
    name: str
    focus: str
    skip: str
    skip_groups: tuple[SkipGroup, ...]
    about: str


def _alternation(patterns: tuple[str, ...] | list[str]) -> str:
    return "|".join(f"(?:{p})" for p in patterns)


SUITES: Final = {
    "proxy": Suite(
        "proxy",
        _alternation(PROXY_GROUPS),
        _alternation([g.pattern for g in SKIPS]),
        SKIPS,
        "every [sig-network] Conformance spec and the specs that exercise a service proxy",
    ),
    "conformance": Suite(
        "conformance",
        r"\[sig-network\].*\[Conformance\]",
        _alternation([g.pattern for g in SKIPS]),
        SKIPS,
        "the [sig-network] Conformance specs",
    ),
    "smoke": Suite(
        "smoke",
        _alternation(
            [
                r"\[sig-network\] Services should serve a basic endpoint from pods",
                r"\[sig-network\] Services should be able to create a functioning NodePort",
                r"\[sig-network\] Networking should check kube-proxy urls",
            ]
        ),
        _alternation([g.pattern for g in SKIPS]),
        SKIPS,
        "three Services and Networking specs (CI: the harness cannot rot)",
    ),
}


_METACHARACTERS = re.compile(r"([\\.+*?()|\[\]{}^$])")


def literal(text: str) -> str:
    """`text` as a regex both Python's `re` and ginkgo's RE2 read as the text itself (each
    metacharacter after a backslash; RE2 refuses a backslash before a space or a letter)."""
    return _METACHARACTERS.sub(r"\\\1", text)


def narrowed(suite: Suite, only: str, listed: list[str]) -> Suite:
    """Of `suite`'s specs among `listed` (full texts), those matching `only` too, with the
    suite's skips: a re-run of a few of the suite's specs. The focus names them one by one,
    since ginkgo ORs its focus flags. ValueError when none matches (an empty focus would run
    every spec)."""
    focus, wanted = re.compile(suite.focus), re.compile(only)
    chosen = [spec for spec in listed if focus.search(spec) and wanted.search(spec)]
    if not chosen:
        raise ValueError(f"no spec of the suite {suite.name!r} matches {only!r}")
    return Suite(
        suite.name,
        _alternation([literal(spec) for spec in chosen]),
        suite.skip,
        suite.skip_groups,
        f"{suite.about}; only those matching {only!r}",
    )


def selected(suite: Suite, specs: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Of `specs` (full texts), those `suite` runs, and those its focus names but a skip group
    holds back (by group name; a spec lands in the first group that matches)."""
    focus, run = re.compile(suite.focus), []
    skipped: dict[str, list[str]] = {g.name: [] for g in suite.skip_groups}
    for spec in specs:
        if not focus.search(spec):
            continue
        group = next((g for g in suite.skip_groups if re.search(g.pattern, spec)), None)
        if group is None:
            run.append(spec)
        else:
            skipped[group.name].append(spec)
    return run, skipped
