"""Package the kpx chart for a chart repository (`make chart`).

    python3 charts/package.py [--out build/charts] [--url https://charts.example/kpx]

Lints the chart (`helm lint --strict`), writes `kpx-<version>.tgz` (`helm package`) and the
repository's `index.yaml` (`helm repo index`, merged with an index already there, so the
directory can collect several versions) into --out. Serve that directory as is (any static web
server, a GitHub Pages branch, an OCI registry with `helm push`): `helm repo add kpx URL`. The
helm is the pinned one (toolchain/helm/go.mod, built by `make setup-helm`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "kpx"
DEFAULT_OUT = REPO / "build" / "charts"


def helm_binary() -> Path:
    """The pinned helm in the cache ($PROXY_CACHE_DIR/bin/<version>/helm)."""
    go_mod = (REPO / "toolchain" / "helm" / "go.mod").read_text(encoding="utf-8")
    pinned = re.search(r"^\s*(?:require\s+)?helm\.sh/helm/v3 (v\S+)$", go_mod, re.M)
    if pinned is None:
        raise SystemExit("toolchain/helm/go.mod does not require helm.sh/helm/v3")
    cache = Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))
    path = cache / "bin" / pinned.group(1) / "helm"
    if not os.access(path, os.X_OK):
        raise SystemExit(f"helm is not built ({path} missing): run `make setup-helm`")
    return path


def package(out: Path, url: str | None = None, helm: Path | None = None) -> Path:
    """Lint, package and index the chart into `out`; the package's path."""
    helm = helm or helm_binary()
    out.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> str:
        done = subprocess.run([str(helm), *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"helm {args[0]} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    run("lint", "--strict", str(CHART))
    said = run("package", str(CHART), "--destination", str(out))
    # "Successfully packaged chart and saved it to: <path>"
    tgz = Path(said.strip().rsplit(": ", 1)[-1])
    index = ["repo", "index", str(out)]
    if url:
        index += ["--url", url]
    if (out / "index.yaml").exists():
        index += ["--merge", str(out / "index.yaml")]
    run(*index)
    return tgz


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="charts/package.py", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: build/charts")
    parser.add_argument("--url", help="the repository's URL, written into index.yaml")
    args = parser.parse_args(argv)
    tgz = package(args.out, args.url)
    print(f"chart: {tgz}")
    print(f"index: {args.out / 'index.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
