#!/usr/bin/env python3
"""Install the development workspace: every distribution of this tree editable, with the
third-party requirements they declare and the root's `dev` dependency group.

    python3 toolchain/setup-python.py          # `make setup-python`
    python3 toolchain/setup-python.py --check  # exit 1 if something is missing or stale

The distributions are the folders listed in the root pyproject.toml under
[tool.kpx.workspace] (api/, kube/, agents/kpx_localstate_client/, agents/,
operator/, harness/), each with its own pyproject.toml. They name each other by direct
reference to the sibling folder (`kpx-api @ file:///.../api`),
which pip cannot reconcile with an editable install of that folder: so the distributions are
installed with --no-deps and their third-party requirements separately.

Nothing is installed or built when everything is in place already: each distribution installed
editable from this tree, at its version, with its console scripts; every requirement satisfied.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ("kpx",)
"""Distributions this tree used to install (one `kpx` for everything): removed first."""


def load(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def members() -> list[Path]:
    names = load(ROOT)["tool"]["kpx"]["workspace"]["distributions"]
    return [ROOT / name for name in names]


def third_party(requirements: list[str], own: set[str]) -> list[str]:
    """Requirements that name no distribution of this tree."""
    return [r for r in requirements if normalize(requirement_name(r)) not in own]


def requirement_name(requirement: str) -> str:
    for i, char in enumerate(requirement):
        if not (char.isalnum() or char in "-_."):
            return requirement[:i]
    return requirement


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def problems() -> list[str]:
    """What is missing or stale; empty when the workspace is installed."""
    importlib.invalidate_caches()  # after install(): see what pip just put there
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["packaging is not installed"]
    out: list[str] = []
    for name in LEGACY:
        try:
            metadata.distribution(name)
            out.append(f"{name}: the former single distribution is installed")
        except metadata.PackageNotFoundError:
            pass
    own = {normalize(load(m)["project"]["name"]) for m in members()}
    requirements = list(load(ROOT)["dependency-groups"]["dev"])
    for folder in members():
        project = load(folder)["project"]
        name = project["name"]
        requirements += third_party(project.get("dependencies", []), own)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name}: not installed")
            continue
        if dist.version != project["version"]:
            out.append(f"{name}: {dist.version} installed, {project['version']} in the tree")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if not (
            direct.get("dir_info", {}).get("editable")
            and direct.get("url") == folder.resolve().as_uri()
        ):
            out.append(f"{name}: not installed editable from {folder}")
        scripts = {ep.name: ep.value for ep in dist.entry_points.select(group="console_scripts")}
        if scripts != project.get("scripts", {}):
            out.append(f"{name}: console scripts {scripts} differ from the tree's")
    for text in requirements:
        req = Requirement(text)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name}: {version} installed, {req.specifier} required")
    return out


def pip(*args: str) -> None:
    argv = [sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"]
    print("+", " ".join(argv[1:]), flush=True)
    subprocess.run(argv, check=True, cwd=ROOT)


def install() -> None:
    for name in LEGACY:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        pip("uninstall", "-y", name)
    own = {normalize(load(m)["project"]["name"]) for m in members()}
    requirements = list(load(ROOT)["dependency-groups"]["dev"])
    editables: list[str] = []
    for folder in members():
        requirements += third_party(load(folder)["project"].get("dependencies", []), own)
        editables += ["-e", str(folder)]
    pip("install", *dict.fromkeys(requirements))
    pip("install", "--no-deps", *editables)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report what is missing")
    args = parser.parse_args()
    missing = problems()
    if not missing:
        names = ", ".join(load(m)["project"]["name"] for m in members())
        print(f"python: workspace installed ({names} editable)")
        return 0
    for line in missing:
        print(f"python: {line}")
    if args.check:
        return 1
    install()
    left = problems()
    for line in left:
        print(f"python: still: {line}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
