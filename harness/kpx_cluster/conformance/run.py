"""`make conformance`: Kubernetes' own `[sig-network]` e2e specs against kpx and upstream
kube-proxy on real kubelets, side by side.

    python -m kpx_cluster.conformance [--suite proxy|conformance|smoke]
        [--targets kpx/nftables,kpx/iptables,kube-proxy/nftables,kube-proxy/iptables]
        [--procs 3] [--out DIR] [--record FILE]

For each target (proxy/mode) it brings up a fresh `RealCluster` (2 real kubelet nodes,
dual-stack, cluster DNS), installs the proxy from its image as users do
(`kubelets.install`), runs the suite's specs with the ginkgo CLI over the pinned `e2e.test`
(both built by `make setup`) from inside the control plane's network namespace (routes to
every pod and node address, no default route: nothing leaves the machine), reads the JUnit
report, and takes the cluster down. It then prints the table, why each skipped group does not
run, every failure, and each spec kube-proxy passes that kpx fails in the same mode.
Exit status 1 when kpx fails a spec kube-proxy passes (or, without a baseline, any spec).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..binaries import cache_dir, kubernetes_binary
from ..kubelets import debian_images, install, static_images
from ..kubelets.cluster import RealCluster
from . import results, specs

NODES = 2
MODES = ("nftables", "iptables", "ipvs")
DEFAULT_TARGETS = ("kpx/nftables", "kpx/iptables", "kube-proxy/nftables", "kube-proxy/iptables")
_LISTED = re.compile(r"^\s*\S+:\d+: (\[.*)$")


@dataclass(frozen=True)
class Target:
    proxy: str
    mode: str

    @classmethod
    def parse(cls, text: str) -> Target:
        proxy, _, mode = text.partition("/")
        if proxy not in install.PROXIES or mode not in MODES:
            raise argparse.ArgumentTypeError(
                f"target {text!r}: PROXY/MODE with PROXY one of {', '.join(install.PROXIES)} "
                f"and MODE one of {', '.join(MODES)}"
            )
        return cls(proxy, mode)

    @property
    def label(self) -> str:
        return f"{self.proxy}-{self.mode}"


def list_specs() -> list[str]:
    """Every spec `e2e.test` holds, by its full text."""
    out = subprocess.run(
        [str(kubernetes_binary("e2e.test")), "--list-tests"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return [m.group(1).strip() for line in out.splitlines() if (m := _LISTED.match(line))]


def test_images() -> list[Path]:
    """The suite's images every node imports (pause, busybox and CoreDNS come with the nodes):
    agnhost, glibc-dns-testing, nginx."""
    return static_images.ensure(log=lambda _: None, wanted=debian_images.DEBIAN_IMAGES)


def ginkgo_argv(suite: specs.Suite, procs: int, kubeconfig: Path, report_dir: Path) -> list[str]:
    return [
        str(kubernetes_binary("ginkgo")),
        f"--procs={procs}",
        f"--focus={suite.focus}",
        f"--skip={suite.skip}",
        "--no-color",
        "--timeout=3h",
        str(kubernetes_binary("e2e.test")),
        "--",
        "--provider=skeleton",
        f"--kubeconfig={kubeconfig}",
        f"--kubectl-path={kubernetes_binary('kubectl')}",
        f"--num-nodes={NODES}",
        f"--report-dir={report_dir}",
        "--e2e-verify-service-account=false",
    ]


def run_target(
    target: Target, suite: specs.Suite, selected: list[str], procs: int, out: Path
) -> results.Row:
    report_dir = out / target.label
    report_dir.mkdir(parents=True, exist_ok=True)
    log = report_dir / "e2e.log"
    started = time.monotonic()
    try:
        _run_suite(target, suite, selected, procs, report_dir, log)
    except Exception as exc:  # the target's row says it; the other targets still run
        print(f"conformance: {target.label}: {type(exc).__name__}: {exc}", file=sys.stderr)
        (report_dir / "error").write_text(f"{type(exc).__name__}: {exc}\n")
    (report_dir / "seconds").write_text(f"{time.monotonic() - started:.1f}\n")
    return read_row(target, selected, out)


def read_row(target: Target, selected: list[str], out: Path) -> results.Row:
    """The row of `target` from its reports in `out` (its JUnit file, wall time, error)."""
    report_dir = out / target.label
    junit = report_dir / "junit_01.xml"
    data = junit.read_bytes() if junit.exists() else b"<testsuites/>"
    outcome = results.parse_junit(data, selected)
    error = report_dir / "error"
    if error.exists():
        outcome.suite_failures["setup"] = error.read_text().strip()
    conformance = [s for s in selected if "[Conformance]" in s]
    passed = set(outcome.passed)
    seconds_file = report_dir / "seconds"
    seconds = float(seconds_file.read_text()) if seconds_file.exists() else 0.0
    return results.Row(
        target.proxy,
        target.mode,
        outcome,
        seconds,
        (sum(1 for s in conformance if s in passed), len(conformance)),
    )


def _run_suite(
    target: Target,
    suite: specs.Suite,
    selected: list[str],
    procs: int,
    report_dir: Path,
    log: Path,
) -> None:
    # ipvs: the nodes run in a proxy-vm guest, whose kernel has IPVS (this host's has not).
    rc = RealCluster(
        f"conf-{target.label}-{os.getpid()}",
        nodes=NODES,
        archives=test_images(),
        late_archives=install.archives(target.proxy),
        vm=f"conf{os.getpid()}" if target.mode == "ipvs" else None,
    )
    rc.up(timeout=240)
    try:
        install.install(rc, target.proxy, target.mode)
        kubeconfig = rc.cluster.client_kubeconfig(
            "e2e-admin",
            ("system:masters",),
            report_dir / "kubeconfig",
            server=rc.cluster.cluster_server,
        )
        assert rc.cluster.netns is not None
        argv = [
            "nsenter",
            f"--net=/run/netns/{rc.cluster.netns}",
            *ginkgo_argv(suite, procs, kubeconfig, report_dir),
        ]
        print(f"conformance: {target.label}: {len(selected)} specs, log {log}", flush=True)
        with log.open("wb") as sink:
            env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
            subprocess.run(
                argv, stdout=sink, stderr=subprocess.STDOUT, check=False, cwd=report_dir, env=env
            )
    finally:
        left = rc.down()
        if left:
            print(f"conformance: {target.label}: down left {left}", file=sys.stderr)


def report(rows: list[results.Row], suite: specs.Suite, skipped: dict[str, list[str]]) -> str:
    parts = [results.table(rows, suite.name), ""]
    parts.append(f"Suite `{suite.name}`: {suite.about}.")
    held_back = [g for g in suite.skip_groups if skipped.get(g.name)]
    if held_back:
        parts.append("Not run, by group (specs of the suite's focus that a reason holds back):")
    for group in held_back:
        parts.append(f"- {group.name} ({len(skipped[group.name])}): {group.reason}")
    for row in rows:
        if row.outcome.suite_failures:
            for name, why in row.outcome.suite_failures.items():
                parts.append(f"- {row.proxy}/{row.mode} suite step {name}: {why}")
        for name, why in sorted(row.outcome.failed.items()):
            parts.append(f"- FAILED {row.proxy}/{row.mode}: {name}: {why}")
    by_key = {(r.proxy, r.mode): r for r in rows}
    for row in rows:
        base = by_key.get(("kube-proxy", row.mode))
        if row.proxy == "kpx" and base is not None:
            worse = results.regressions(base.outcome, row.outcome)
            verdict = "none" if not worse else "; ".join(worse)
            parts.append(f"- kpx/{row.mode} fails where kube-proxy/{row.mode} passes: {verdict}")
    return "\n".join(parts)


def failed(rows: list[results.Row]) -> bool:
    by_key = {(r.proxy, r.mode): r for r in rows}
    for row in rows:
        if row.proxy != "kpx":
            continue
        base = by_key.get(("kube-proxy", row.mode))
        if base is not None:
            if results.regressions(base.outcome, row.outcome):
                return True
        elif row.outcome.failed:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kpx_cluster.conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--suite", choices=sorted(specs.SUITES), default="proxy")
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help="comma-separated PROXY/MODE (default: %(default)s)",
    )
    parser.add_argument("--procs", type=int, default=3, help="ginkgo processes (default 3)")
    parser.add_argument(
        "--out", type=Path, default=None, help="reports directory (default: cache/conformance/)"
    )
    parser.add_argument(
        "--only",
        default="",
        metavar="REGEX",
        help="of the suite's specs, run only those whose text matches REGEX",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the targets from the reports already in --out",
    )
    parser.add_argument(
        "--record", type=Path, default=None, help="also write the report (Markdown) to this file"
    )
    args = parser.parse_args(argv)
    try:
        targets = [Target.parse(t) for t in args.targets.split(",") if t]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if os.geteuid() != 0:
        parser.error("real nodes need root (namespaces, cgroups, mounts)")
    suite = specs.SUITES[args.suite]
    listed = list_specs()
    if args.only:
        try:
            suite = specs.narrowed(suite, args.only, listed)
        except (ValueError, re.error) as exc:
            parser.error(f"--only: {exc}")
    out = args.out or cache_dir() / "conformance" / time.strftime("%Y%m%dT%H%M%S")
    selected, skipped = specs.selected(suite, listed)
    if args.report_only:
        if args.out is None:
            parser.error("--report-only needs --out (the reports' directory)")
        rows = [read_row(t, selected, out) for t in targets]
    else:
        rows = [run_target(t, suite, selected, args.procs, out) for t in targets]
    text = report(rows, suite, skipped)
    print(text)
    if args.record:
        args.record.write_text(
            f"# `make conformance` ({time.strftime('%Y-%m-%d')}, e2e.test "
            f"{kubernetes_binary('e2e.test').parent.name}, {NODES} real kubelet nodes, "
            f"{args.procs} ginkgo processes)\n\n{text}\n"
        )
    return 1 if failed(rows) else 0
