"""Upstream kube-proxy's metrics, read from its source (pkg/proxy/metrics/metrics.go): each
metric's name, type, labels and buckets, and which ones RegisterMetrics(mode) registers per
mode. The source is read from the Go module cache when it is there (toolchain/ builds the
Kubernetes binaries from it); `metrics_reference/kube-proxy-metrics.json` holds the same, made
from it by `python3 tests/e2e/upstream_metrics.py`, for machines without it. And the metric
names the kubernetes-mixin Proxy dashboard's queries read."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

KUBERNETES_VERSION = "v1.36.2"
SOURCE = f"k8s.io/kubernetes@{KUBERNETES_VERSION}/pkg/proxy/metrics/metrics.go"
REFERENCE = Path(__file__).parent / "metrics_reference"
KUBE_PROXY_JSON = REFERENCE / "kube-proxy-metrics.json"
DASHBOARD_JSON = REFERENCE / "kubernetes-mixin-proxy-dashboard.json"
MODES = {
    "IPTables": "iptables",
    "IPVS": "ipvs",
    "NFTables": "nftables",
    "Kernelspace": "kernelspace",
}

_VAR = re.compile(
    r"^\t(\w+) = metrics\.New(Histogram|Gauge|Counter)(Vec)?\(\s*&metrics\.\w+Opts\{(.*?)\n\t\t\},"
    r"(?:\s*\[\]string\{([^}]*)\},)?",
    re.S | re.M,
)
_DESC = re.compile(r"^\t(\w+) = metrics\.NewDesc\(\s*\"(\w+)\"", re.M)
_BUCKETS = re.compile(r"Buckets:\s*(metrics\.\w+\((?:[^()]|\([^()]*\))*\))", re.S)


def source_path() -> Path:
    cache = os.environ.get("GOMODCACHE") or str(Path.home() / "go" / "pkg" / "mod")
    return Path(cache) / SOURCE


def _buckets(expr: str) -> list[float]:
    """metrics.ExponentialBuckets / LinearBuckets / MergeBuckets, evaluated."""
    text = re.sub(r"//[^\n]*", "", expr).replace("metrics.", "")

    def value(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), ast.dump(node)
        args = [value(a) for a in node.args]
        if node.func.id == "ExponentialBuckets":
            start, factor, count = args
            return [start * factor**i for i in range(count)]
        if node.func.id == "LinearBuckets":
            start, width, count = args
            return [start + width * i for i in range(count)]
        if node.func.id == "MergeBuckets":
            return sorted({b for part in args for b in part})
        raise ValueError(f"unknown bucket function {node.func.id}")

    return [float(b) for b in value(ast.parse(text, mode="eval").body)]


def parse(go: str) -> dict[str, Any]:
    """{"metrics": {name: {type, labels, buckets?}}, "modes": {mode: [names]}}."""
    by_var: dict[str, str] = {}
    metrics: dict[str, dict[str, Any]] = {}
    for var, kind, _vec, body, labels in _VAR.findall(go):
        name = re.search(r'Name:\s*"(\w+)"', body)
        assert name is not None, var
        subsystem = "kubeproxy_" if re.search(r"Subsystem:\s*kubeProxySubsystem", body) else ""
        full = subsystem + name.group(1)
        entry: dict[str, Any] = {
            "type": kind.lower(),
            "labels": re.findall(r'"(\w+)"', labels or ""),
        }
        if (buckets := _BUCKETS.search(body)) is not None:
            entry["buckets"] = _buckets(buckets.group(1))
        by_var[var] = full
        metrics[full] = entry
    for var, name in _DESC.findall(go):
        by_var[var] = name
        metrics[name] = {"type": "counter", "labels": []}
    register = go[go.index("func RegisterMetrics(") :]
    register = register[: register.index("\n}\n")]
    common, _, cases = register.partition("switch mode {")

    def registered(section: str) -> list[str]:
        names = re.findall(r"(?<!Custom)MustRegister\((\w+)\)", section)
        names += re.findall(r"newNFAcctMetricCollector\(\w+, (\w+)\)", section)
        return [by_var[v] for v in names]

    modes: dict[str, list[str]] = {}
    parts = re.split(r"case kubeproxyconfig\.ProxyMode(\w+):", cases)
    for mode, section in zip(parts[1::2], parts[2::2], strict=True):
        modes[MODES[mode]] = registered(common) + registered(section)
    return {"source": SOURCE, "metrics": metrics, "modes": modes}


def kube_proxy_metrics() -> dict[str, Any]:
    """From the source when the module cache has it, else the checked-in reference."""
    path = source_path()
    if path.exists():
        return parse(path.read_text())
    return dict(json.loads(KUBE_PROXY_JSON.read_text()))


def dashboard_metrics() -> tuple[set[str], dict[str, str]]:
    """Metric names the Proxy dashboard's queries read (a histogram's _bucket and _count are
    its samples: the names stay as written), and those no target serves (why)."""
    doc = json.loads(DASHBOARD_JSON.read_text())
    names: set[str] = set()
    for query in doc["queries"]:
        names |= set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query))
    return names, dict(doc["not_served_by_the_target"])


if __name__ == "__main__":
    found = source_path()
    if not found.exists():
        sys.exit(f"{found} is not there (go mod download k8s.io/kubernetes@{KUBERNETES_VERSION})")
    KUBE_PROXY_JSON.write_text(json.dumps(parse(found.read_text()), indent=2) + "\n")
