"""What a run of e2e.test reported (its JUnit file), and the table `make conformance` prints
(pure: no I/O besides parsing the bytes given)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET  # our own e2e.test's report, not untrusted input
from dataclasses import dataclass, field

_LEAF = re.compile(
    r"^\[(It|SynchronizedBeforeSuite|SynchronizedAfterSuite|ReportAfterSuite|"
    r"BeforeSuite|AfterSuite|DeferCleanup \(Suite\))\]\s*"
)


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # spec -> first line of its failure
    skipped: list[str] = field(default_factory=list)  # skipped at run time (e.g. needs 3 zones)
    suite_failures: dict[str, str] = field(default_factory=dict)  # BeforeSuite and friends

    @property
    def ran(self) -> int:
        return len(self.passed) + len(self.failed)


def spec_name(testcase_name: str) -> str:
    """`[It] [sig-network] Services should ... [Conformance]` -> the spec's text, as
    `e2e.test --list-tests` names it (without the leaf node type, labels as in the text)."""
    return _LEAF.sub("", testcase_name).strip()


def parse_junit(data: bytes, selected: list[str]) -> Outcome:
    """The outcome of each spec of `selected` (full texts). A spec the report does not show as
    run (focus mismatch, interrupted run) counts as failed: a run must account for every spec."""
    root = ET.fromstring(data)  # noqa: S314 - see the import
    wanted = set(selected)
    out = Outcome()
    seen: set[str] = set()
    for case in root.iter("testcase"):
        raw = case.get("name", "")
        name = spec_name(raw)
        failure = case.find("failure")
        error = case.find("error")
        bad = failure if failure is not None else error
        if not raw.startswith("[It]"):
            if bad is not None:
                out.suite_failures[raw] = _first_line(bad)
            continue
        if name not in wanted:
            continue
        seen.add(name)
        if bad is not None:
            out.failed[name] = _first_line(bad)
        elif case.find("skipped") is not None or case.get("status") == "skipped":
            out.skipped.append(name)
        else:
            out.passed.append(name)
    for name in selected:
        if name not in seen:
            out.failed[name] = "not in the report: the run did not reach it"
    return out


def _first_line(element: ET.Element) -> str:
    text = (element.get("message") or element.text or "").strip()
    return text.splitlines()[0][:300] if text else "(no message)"


@dataclass(frozen=True)
class Row:
    proxy: str
    mode: str
    outcome: Outcome
    seconds: float
    conformance: tuple[int, int]  # Conformance specs passed, of selected


def table(rows: list[Row], suite: str) -> str:
    """A Markdown table: proxy x mode, passed / failed / skipped, Conformance, wall time."""
    lines = [
        f"| proxy | mode | passed | failed | skipped | Conformance passed | wall time ({suite}) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o = r.outcome
        minutes, seconds = divmod(round(r.seconds), 60)
        lines.append(
            f"| {r.proxy} | {r.mode} | {len(o.passed)} | {len(o.failed)} | {len(o.skipped)} "
            f"| {r.conformance[0]}/{r.conformance[1]} | {minutes} min {seconds:02d} s |"
        )
    return "\n".join(lines)


def regressions(baseline: Outcome, candidate: Outcome) -> list[str]:
    """Specs the baseline passes and the candidate does not (each one a bug to fix)."""
    return sorted(set(baseline.passed) - set(candidate.passed))
