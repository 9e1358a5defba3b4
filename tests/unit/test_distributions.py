"""Each distribution of this tree (api/, agents/, operator/, harness/, each with its own
pyproject.toml) declares exactly what its packages import: every third-party or sibling
top-level import is a declared requirement, and every requirement is imported. The product
(kpx-api, kpx-agent, kpx-operator) never depends on the harness, and the agent does not ship
kopf or cryptography, not even through the requirements of its requirements."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kpx-api", "kpx-agent", "kpx-operator")
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


def packages_of(folder: str) -> list[str]:
    return list(pyproject(folder)["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])


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
    for package in own_packages:
        for module, where in top_level_imports(ROOT / folder / package).items():
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
    folders = sorted(p.parent.name for p in ROOT.glob("*/pyproject.toml"))
    assert sorted(members()) == folders


@pytest.mark.parametrize("folder", members())
def test_declared_requirements_are_exactly_what_the_packages_import(folder: str) -> None:
    declared = {normalize(r.name) for r in requirements_of(folder)}
    needed = needed_distributions(folder)
    missing = {d: why for d, why in needed.items() if d not in declared}
    assert not missing, f"{folder}/pyproject.toml does not declare: {missing}"
    unused = declared - needed.keys()
    assert not unused, f"{folder}/pyproject.toml declares what nothing imports: {sorted(unused)}"


@pytest.mark.parametrize("folder", members())
def test_siblings_are_referenced_by_folder_never_by_registry(folder: str) -> None:
    """`pip install ./agents` takes kpx-api from ../api: a registry never supplies our names."""
    siblings = {name_of(m): m for m in members()}
    for req in requirements_of(folder):
        if normalize(req.name) in siblings:
            assert req.url == f"{{root:parent:uri}}/{siblings[normalize(req.name)]}", req


@pytest.mark.parametrize("folder", members())
def test_console_scripts_name_functions_of_the_distribution(folder: str) -> None:
    for script, target in pyproject(folder)["project"].get("scripts", {}).items():
        module, _, function = target.partition(":")
        assert module.split(".")[0] in packages_of(folder), f"{script} -> {target}"
        source = ROOT / folder / (module.replace(".", "/") + ".py")
        defined = {
            node.name for node in ast.parse(source.read_text()).body
            if isinstance(node, ast.FunctionDef)
        }  # fmt: skip
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
            normalize(r.name) for r in reqs
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]  # fmt: skip
    return seen


@pytest.mark.parametrize("product", PRODUCT)
def test_the_product_does_not_depend_on_the_harness(product: str) -> None:
    assert HARNESS not in closure(product)
    assert "cryptography" not in closure(product)


def test_the_agent_ships_neither_kopf_nor_the_operator() -> None:
    shipped = closure("kpx-agent")
    assert {"kopf", "kpx-operator", "jinja2"}.isdisjoint(shipped), shipped
    assert "kpx-api" in shipped


def test_mypy_checks_every_package() -> None:
    packages = {pkg for m in members() for pkg in packages_of(m)}
    assert set(pyproject(".")["tool"]["mypy"]["packages"]) == packages
