"""The images' build inputs: one version, pinned dependencies, a cache key that moves with
every file the build copies and with nothing else."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

import kpx_operator
from kpx_cluster import images
from kpx_operator.builders import DEFAULT_AGENT_IMAGE

REPO = Path(__file__).resolve().parents[2]


def test_one_version_names_every_image() -> None:
    version = images.project_version()
    operator, agent = images.images(version)
    assert (operator.ref, agent.ref) == (
        f"ghcr.io/kpx/kpx-operator:{version}",
        f"ghcr.io/kpx/kpx-agent:{version}",
    )
    # The operator's own version and its default agent image are the same version.
    assert kpx_operator.__version__ == version
    assert agent.ref == DEFAULT_AGENT_IMAGE
    deployment = (REPO / "operator/manifests/deployment.yaml").read_text()
    assert f"image: {operator.ref}\n" in deployment
    assert f'"--agent-image", "{agent.ref}"' in deployment


def test_containerfile_has_both_targets_with_their_entry_points() -> None:
    text = (REPO / images.CONTAINERFILE).read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert {"build", "runtime", "agent", "operator"} <= set(stages)
    assert 'ENTRYPOINT ["proxy-agent"]' in stages["agent"]
    assert 'ENTRYPOINT ["proxy-operator"]' in stages["operator"]
    assert re.search(r"^USER 65532:65532$", stages["operator"], re.M)  # non-root
    for tool in ("nftables", "iptables", "conntrack"):
        assert tool in stages["agent"]
    assert f"ARG BASE={images.BASE_IMAGE}" in text


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_distributions(*tops: str) -> set[str]:
    """Third-party distributions the code under `tops` (e.g. api/, agents/) imports."""
    modules: set[str] = set()
    for top in tops:
        for path in (REPO / top).rglob("*.py"):
            if path.is_relative_to(REPO / "api" / "proto"):
                continue  # the .proto's code generator: a development tool, not in the images
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    by_module = importlib.metadata.packages_distributions()
    third_party = modules - set(sys.stdlib_module_names)
    found = {_normal(d) for m in third_party for d in by_module.get(m, [])}
    return {d for d in found if not d.startswith("kpx")}  # the product itself


def _declared_dependencies() -> set[str]:
    """Dependencies api/, agents/ and operator/ declare, once each has its pyproject.toml."""
    found: set[str] = set()
    for top in ("api", "agents", "operator"):
        if (path := REPO / top / "pyproject.toml").exists():
            for dep in tomllib.loads(path.read_text())["project"].get("dependencies", []):
                name = re.match(r"[A-Za-z0-9_.-]+", dep)
                assert name is not None
                found.add(_normal(name.group(0)))
    return {d for d in found if not d.startswith("kpx")}


def _pinned(name: str) -> dict[str, str]:
    pinned = {}
    for line in (REPO / "images" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pinned[package] = version
    return pinned


def test_requirements_pin_every_imported_and_declared_dependency() -> None:
    """requirements.txt (both images) covers api/ and agents/; requirements-operator.txt adds
    what operator/ needs (kopf), which the agent image does without."""
    common, operator = _pinned("requirements.txt"), _pinned("requirements-operator.txt")
    assert not common.keys() & operator.keys()
    agent_imports = _imported_distributions("api", "agents")
    assert {"pydantic", "aiohttp", "pyyaml"} <= agent_imports  # the scan finds them
    assert not agent_imports - common.keys(), "requirements.txt lacks what agents/ imports"
    everything = _imported_distributions("api", "agents", "operator") | _declared_dependencies()
    assert "kopf" in everything and "kopf" in operator
    missing = everything - common.keys() - operator.keys()
    assert not missing, f"images/requirements*.txt lack {sorted(missing)}"
    # Nothing only the harness needs.
    assert not {"cryptography", "jinja2"} & (common.keys() | operator.keys())


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """The files the digest reads, copied (the build context and the chart's version)."""
    root = tmp_path / "repo"
    for top in (*images.CONTEXT_PATHS, "charts/kpx/Chart.yaml"):
        src = REPO / top
        if src.is_dir():
            shutil.copytree(src, root / top, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / top).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / top)
    return root


def test_inputs_digest_moves_with_the_build_context_only(repo_copy: Path) -> None:
    first = images.inputs_digest(repo_copy)
    assert images.inputs_digest(repo_copy) == first  # stable
    # Caches and files outside the context do not rebuild anything.
    (repo_copy / "agents/kpx_agent/__pycache__").mkdir(exist_ok=True)
    (repo_copy / "agents/kpx_agent/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    (repo_copy / "tests").mkdir()
    (repo_copy / "tests/test_new.py").write_text("x = 1\n")
    assert images.inputs_digest(repo_copy) == first
    # A source change, a new file, a mode change and another base each do.
    cli = repo_copy / "agents/kpx_agent/cli.py"
    cli.write_text(cli.read_text() + "\n")
    changed = images.inputs_digest(repo_copy)
    assert changed != first
    (repo_copy / "operator/kpx_operator/new.py").write_text("")
    added = images.inputs_digest(repo_copy)
    assert added != changed
    (repo_copy / "images/iptables-wrapper").chmod(0o644)
    assert images.inputs_digest(repo_copy) != added
    assert images.inputs_digest(repo_copy, base="debian:trixie-slim") != images.inputs_digest(
        repo_copy
    )


def test_up_to_date_needs_the_archive_and_the_same_digest(tmp_path: Path) -> None:
    _, agent = images.images("1.2.3")
    assert agent.archive(tmp_path) == tmp_path / "kpx-agent-1.2.3.oci.tar"
    assert not images.up_to_date(agent, tmp_path, "d1")
    agent.archive(tmp_path).write_bytes(b"archive")
    assert not images.up_to_date(agent, tmp_path, "d1")  # no stamp: built by what?
    (tmp_path / "kpx-agent-1.2.3.oci.tar.inputs").write_text("d1\n")
    assert images.up_to_date(agent, tmp_path, "d1")
    assert not images.up_to_date(agent, tmp_path, "d2")
