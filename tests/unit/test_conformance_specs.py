"""The conformance suites' spec selection and the JUnit outcome/table (pure)."""

from __future__ import annotations

import re

import pytest

from kpx_cluster.conformance import results, specs

LISTED = [
    "[sig-network] Services should serve a basic endpoint from pods  [Conformance]",
    "[sig-network] Services should be able to create a functioning NodePort service [Conformance]",
    "[sig-network] Services should implement service.kubernetes.io/headless",
    "[sig-network] Services should work after restarting kube-proxy [Disruptive]",
    "[sig-network] Services should serve endpoints on same port and different protocol for "
    "internal traffic on Type LoadBalancer",
    "[sig-network] Networking Granular Checks: Services should function for pod-Service: http",
    "[sig-network] Networking Granular Checks: Services should function for pod-Service: sctp "
    "[Feature:SCTPConnectivity]",
    "[sig-network] Networking should check kube-proxy urls",
    "[sig-network] DNS should provide DNS for services  [Conformance]",
    "[sig-network] DNS should support configurable pod resolv.conf",
    "[sig-network] Netpol API should support creating NetworkPolicy API operations",
    "[sig-network] [Feature:IPv6DualStack] should create service with ipv6 cluster ip",
    "[sig-storage] Volumes should store data [Conformance]",
]


def test_the_proxy_suite_runs_conformance_and_proxy_specs_and_names_why_others_do_not() -> None:
    run, skipped = specs.selected(specs.SUITES["proxy"], LISTED)
    assert run == [
        LISTED[0],
        LISTED[1],
        LISTED[2],
        LISTED[5],
        LISTED[7],
        LISTED[8],
        LISTED[11],
    ]
    assert skipped["disruptive"] == [LISTED[3]]
    assert skipped["cloud load balancers"] == [LISTED[4]]
    assert skipped["sctp"] == [LISTED[6]]
    # outside the focus: not the proxy's (DNS beyond Conformance, NetworkPolicy, other SIGs)
    for spec in (LISTED[9], LISTED[10], LISTED[12]):
        assert spec not in run and all(spec not in v for v in skipped.values())
    assert all(group.reason for group in specs.SKIPS)


def test_the_conformance_suite_is_the_sig_network_conformance_specs() -> None:
    run, _ = specs.selected(specs.SUITES["conformance"], LISTED)
    assert run == [LISTED[0], LISTED[1], LISTED[8]]


def test_smoke_is_a_few_services_specs() -> None:
    run, _ = specs.selected(specs.SUITES["smoke"], LISTED)
    assert run == [LISTED[0], LISTED[1], LISTED[7]]


JUNIT = b"""<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4" failures="1">
  <testsuite name="Kubernetes e2e suite" tests="4">
    <testcase name="[SynchronizedBeforeSuite]" status="passed" time="1"></testcase>
    <testcase
      name="[It] [sig-network] Services should serve a basic endpoint from pods  [Conformance]"
      status="passed" time="12"></testcase>
    <testcase name="[It] [sig-network] Networking should check kube-proxy urls" status="failed">
      <failure message="[FAILED] got 404 for /proxyMode&#10;more" type="failed">trace</failure>
    </testcase>
    <testcase name="[It] [sig-network] Topology Hints should distribute endpoints evenly"
              status="skipped"><skipped message="needs 3 zones"></skipped></testcase>
    <testcase name="[It] [sig-storage] Volumes should store data [Conformance]" status="skipped">
      <skipped message="skipped"></skipped></testcase>
  </testsuite>
</testsuites>
"""
SELECTED = [
    "[sig-network] Services should serve a basic endpoint from pods  [Conformance]",
    "[sig-network] Networking should check kube-proxy urls",
    "[sig-network] Topology Hints should distribute endpoints evenly",
    "[sig-network] Services should implement service.kubernetes.io/headless",
]


def test_junit_outcome_accounts_for_every_selected_spec() -> None:
    out = results.parse_junit(JUNIT, SELECTED)
    assert out.passed == [SELECTED[0]]
    assert out.failed[SELECTED[1]] == "[FAILED] got 404 for /proxyMode"
    assert out.skipped == [SELECTED[2]]
    # selected but absent from the report: counted as failed, never silently dropped
    assert out.failed[SELECTED[3]].startswith("not in the report")
    assert out.ran == 3


def test_table_and_regressions_against_the_baseline() -> None:
    kpx = results.parse_junit(JUNIT, SELECTED)
    base = results.Outcome(passed=[*SELECTED[:2], SELECTED[3]])
    assert results.regressions(base, kpx) == sorted([SELECTED[1], SELECTED[3]])
    text = results.table(
        [
            results.Row("kpx", "nftables", kpx, 754.4, (1, 1)),
            results.Row("kube-proxy", "nftables", base, 61, (1, 1)),
        ],
        "proxy",
    )
    assert "| kpx | nftables | 1 | 2 | 1 | 1/1 | 12 min 34 s |" in text
    assert "| kube-proxy | nftables | 3 | 0 | 0 | 1/1 | 1 min 01 s |" in text


def test_only_narrows_a_suite_to_a_few_specs_and_keeps_its_skips() -> None:
    narrow = specs.narrowed(specs.SUITES["proxy"], r"kube-proxy urls|restarting kube-proxy", LISTED)
    run, skipped = specs.selected(narrow, LISTED)
    assert run == [LISTED[7]]
    assert skipped["disruptive"] == [LISTED[3]]


def test_only_stays_within_the_suite() -> None:
    """`--only` narrows the suite; it does not widen it: a spec outside the suite's focus
    (sig-storage's) is not run though it matches, and a match of nothing is refused (an
    empty focus would run every spec)."""
    narrow = specs.narrowed(specs.SUITES["proxy"], r"\[Conformance\]", LISTED)
    run, _ = specs.selected(narrow, LISTED)
    assert run == [LISTED[0], LISTED[1], LISTED[8]]  # not sig-storage's
    with pytest.raises(ValueError, match="no spec"):
        specs.narrowed(specs.SUITES["proxy"], r"Volumes should store", LISTED)


@pytest.mark.parametrize("spec", LISTED)
def test_a_literal_spec_text_matches_itself_and_reads_as_re2(spec: str) -> None:
    """The narrowed focus quotes each spec: only metacharacters get a backslash (RE2, which
    ginkgo uses, refuses one before a space or a letter)."""
    quoted = specs.literal(spec)
    assert re.fullmatch(quoted, spec)
    assert not re.search(r"\\[^\\.+*?()|\[\]{}^$]", quoted), quoted
