"""Each distribution of this tree (api/, kube/, agents/kpx_localstate_client/,
agents/, operator/, harness/, each with its own pyproject.toml) declares exactly what its
packages import: every third-party or sibling top-level import is a declared requirement, and
every requirement is imported. The product (kpx-api, kpx-kube, kpx-localstate-client,
kpx-agent, kpx-operator) never depends on the harness; the agent does not ship kopf or
cryptography, nor the operator the agent, not even through the requirements of their
requirements; kpx-kube needs no other distribution of this tree."""

from __future__ import annotations

import ast
import os
import posixpath
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kpx-api", "kpx-kube", "kpx-localstate-client", "kpx-agent", "kpx-operator")
HARNESS = "kpx-cluster"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def pyproject(folder: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())


def members() -> list[str]:
    return list(pyproject(".")["tool"]["kpx"]["workspace"]["distributions"])


def name_of(folder: str) -> str:
    return normalize(pyproject(folder)["project"]["name"])


def package_dirs(folder: str) -> dict[str, Path]:
    """Package -> its source folder, from the build backend's configuration (hatchling: the
    wheel's packages; setuptools: packages and package-dir, where the folder can be the
    package itself)."""
    tool = pyproject(folder)["tool"]
    if "hatch" in tool:
        packages = tool["hatch"]["build"]["targets"]["wheel"]["packages"]
        return {pkg: ROOT / folder / pkg for pkg in packages}
    config = tool["setuptools"]
    where = config.get("package-dir", {})
    return {pkg: ROOT / folder / where.get(pkg, pkg) for pkg in config["packages"]}


def packages_of(folder: str) -> list[str]:
    return list(package_dirs(folder))


def requirements_of(folder: str) -> list[Requirement]:
    return [Requirement(r) for r in pyproject(folder)["project"].get("dependencies", [])]


def top_level_imports(package_dir: Path) -> dict[str, str]:
    """Top-level module -> one file importing it, for every absolute import under the folder."""
    out: dict[str, str] = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                out.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return out


def needed_distributions(folder: str) -> dict[str, str]:
    """Distribution -> why (a file importing it), for everything `folder`'s packages import."""
    own_packages = set(packages_of(folder))
    sibling = {pkg: name_of(m) for m in members() for pkg in packages_of(m)}
    installed = metadata.packages_distributions()
    needed: dict[str, str] = {}
    for source in package_dirs(folder).values():
        for module, where in top_level_imports(source).items():
            if module in own_packages or module in sys.stdlib_module_names:
                continue
            if module in sibling:
                needed.setdefault(sibling[module], f"{where} imports {module}")
                continue
            dists = installed.get(module)
            assert dists, f"{where} imports {module}, which no installed distribution provides"
            needed.setdefault(normalize(dists[0]), f"{where} imports {module}")
    return needed


def test_the_workspace_lists_every_distribution_folder() -> None:
    folders = sorted(
        p.parent.relative_to(ROOT).as_posix()
        for p in ROOT.glob("**/pyproject.toml")
        if p.parent != ROOT and not {".git", "build", "node_modules"} & set(p.parts)
    )
    assert sorted(members()) == folders


def test_the_packages_are_the_folders_of_their_distribution() -> None:
    """Every package of the tree is in exactly one distribution, built from its own folder."""
    owners: dict[str, str] = {}
    for folder in members():
        for package, source in package_dirs(folder).items():
            assert package not in owners, f"{package} in {owners.get(package)} and {folder}"
            owners[package] = folder
            assert (source / "__init__.py").is_file(), f"{folder}: {package} is not {source}"
            assert source.name == package


@pytest.mark.parametrize("folder", members())
def test_declared_requirements_are_exactly_what_the_packages_import(folder: str) -> None:
    declared = {normalize(r.name) for r in requirements_of(folder)}
    needed = needed_distributions(folder)
    missing = {d: why for d, why in needed.items() if d not in declared}
    assert not missing, f"{folder}/pyproject.toml does not declare: {missing}"
    unused = declared - needed.keys()
    assert not unused, f"{folder}/pyproject.toml declares what nothing imports: {sorted(unused)}"


def folder_reference(folder: str, target: str) -> str:
    """How hatchling names the folder `target` from the project in `folder`: relative to the
    project's root ({root:uri}) or to its parent ({root:parent:uri})."""
    rel = posixpath.relpath(target, folder)
    if not rel.startswith("../"):
        return f"{{root:uri}}/{rel}"
    rest = rel.removeprefix("../")
    assert not rest.startswith("../"), f"{folder} -> {target}: more than one level up"
    return f"{{root:parent:uri}}/{rest}"


def test_folder_references_follow_the_layout() -> None:
    assert folder_reference("operator", "api") == "{root:parent:uri}/api"
    assert folder_reference("operator", "kube") == "{root:parent:uri}/kube"
    assert folder_reference("agents", "kube") == "{root:parent:uri}/kube"
    assert (
        folder_reference("agents", "agents/kpx_localstate_client")
        == "{root:uri}/kpx_localstate_client"
    )


@pytest.mark.parametrize("folder", members())
def test_siblings_are_referenced_by_folder_never_by_registry(folder: str) -> None:
    """`pip install ./agents` takes kpx-api from ../api: a registry never supplies our names."""
    siblings = {name_of(m): m for m in members()}
    for req in requirements_of(folder):
        if normalize(req.name) in siblings:
            # Only hatchling expands the folder references (setuptools has no such context).
            assert "hatch" in pyproject(folder)["tool"], f"{folder}: {req}"
            assert req.url == folder_reference(folder, siblings[normalize(req.name)]), req


@pytest.mark.parametrize("folder", members())
def test_console_scripts_name_functions_of_the_distribution(folder: str) -> None:
    for script, target in pyproject(folder)["project"].get("scripts", {}).items():
        module, _, function = target.partition(":")
        assert module.split(".")[0] in packages_of(folder), f"{script} -> {target}"
        package, _, rest = module.partition(".")
        source = package_dirs(folder)[package] / (rest.replace(".", "/") + ".py")
        defined = {
            node.name
            for node in ast.parse(source.read_text()).body
            if isinstance(node, ast.FunctionDef)
        }
        assert function in defined, f"{script} -> {target}: no such function"


def closure(name: str) -> set[str]:
    """`name` and everything it requires, transitively (sibling requirements from the tree,
    third-party ones from their installed metadata), without extras."""
    folders = {name_of(m): m for m in members()}
    seen: set[str] = set()
    todo = [normalize(name)]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in folders:
            reqs = requirements_of(folders[current])
        else:
            reqs = [Requirement(r) for r in metadata.requires(current) or []]
        todo += [
            normalize(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return seen


@pytest.mark.parametrize("product", PRODUCT)
def test_the_product_does_not_depend_on_the_harness(product: str) -> None:
    assert HARNESS not in closure(product)
    assert "cryptography" not in closure(product)


def test_the_agent_ships_neither_kopf_nor_the_operator() -> None:
    shipped = closure("kpx-agent")
    assert {"kopf", "kpx-operator", "jinja2"}.isdisjoint(shipped), shipped
    assert {"kpx-api", "kpx-kube", "kpx-localstate-client"} <= shipped


def test_the_operator_ships_neither_the_agent_nor_its_dataplane_libraries() -> None:
    """The operator's client is kpx-kube: not the agent, the state API (grpcio, protobuf),
    netlink (pyroute2) or the agent's metrics (prometheus-client)."""
    shipped = closure("kpx-operator")
    assert {"kpx-kube", "kpx-api", "kopf"} <= shipped
    unwanted = {"kpx-agent", "kpx-localstate-client", "grpcio", "protobuf", "pyroute2"}
    unwanted |= {"prometheus-client"}
    assert unwanted.isdisjoint(shipped), sorted(unwanted & shipped)


def test_the_kube_client_stands_alone() -> None:
    """kpx-kube is the bottom of the tree: it needs no other distribution of it."""
    assert {d for d in closure("kpx-kube") if d.startswith("kpx-")} == {"kpx-kube"}
    assert requirements_of("kube"), "its third-party requirements are declared"


def test_mypy_checks_every_package() -> None:
    packages = {pkg for m in members() for pkg in packages_of(m)}
    assert set(pyproject(".")["tool"]["mypy"]["packages"]) == packages


def test_importing_the_operator_imports_nothing_of_the_agent() -> None:
    """Every module of kpx_operator imported in a fresh interpreter, with the agent importable
    (the tree's PYTHONPATH): none of the agent's packages or dataplane libraries is loaded."""
    code = (
        "import importlib, pkgutil, sys, kpx_operator\n"
        "for m in pkgutil.walk_packages(kpx_operator.__path__, 'kpx_operator.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    path = ":".join(str(ROOT / top) for top in ("api", "kube", "agents", "operator"))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert {"kpx_operator", "kpx_kube", "kpx_api", "kopf"} <= set(out)  # it did import them
    agent = {"kpx_agent", "kpx_localstate_client", "grpc", "google", "pyroute2"}
    agent |= {"prometheus_client"}
    assert not agent & set(out), sorted(agent & set(out))
