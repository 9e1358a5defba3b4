"""The images' build inputs: one version, pinned dependencies, a cache key that moves with
every file the build copies and with nothing else."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    found = re.findall(r"^FROM \S+ AS ([\w-]+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    stages = dict(found)
    assert {"build", "runtime", "agent", "operator"} <= set(stages)
    assert 'ENTRYPOINT ["proxy-agent"]' in stages["agent"]
    assert 'ENTRYPOINT ["proxy-operator"]' in stages["operator"]
    assert re.search(r"^USER 65532:65532$", stages["operator"], re.M)  # non-root
    for tool in ("nftables", "iptables", "ipvsadm"):
        assert tool in stages["agent-rootfs"]
    # Stale conntrack entries are deleted over netlink (kpx_agent.conntrack.stale_flows): no tool.
    assert not re.search(r"\bconntrack\b", stages["agent-rootfs"].split("apt-get install")[1])
    assert f"ARG BASE={images.BASE_IMAGE}" in text
    # Each image is its trimmed root filesystem in one layer (nothing hidden under whiteouts).
    for image in ("agent", "operator"):
        assert re.search(rf"^FROM scratch AS {image}$", text, re.M)
        assert re.findall(r"^(?:COPY|ADD|RUN) .*", stages[image], re.M) == [
            f"COPY --from={image}-rootfs / /"
        ]
        assert re.search(r"^RUN .*slim-rootfs", stages[f"{image}-rootfs"], re.M | re.S)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _workspace() -> dict[str, Path]:
    """Distribution name -> its folder, for every distribution of the tree."""
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    out = {}
    for folder in root["tool"]["kpx"]["workspace"]["distributions"]:
        project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        out[_normal(project["name"])] = REPO / folder
    return out


def _closure(name: str) -> set[str]:
    """`name` and everything it requires, transitively, without extras: the tree's
    distributions from their pyproject.toml, third-party ones from their installed metadata."""
    folders = _workspace()
    seen: set[str] = set()
    todo = [_normal(name)]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in folders:
            project = tomllib.loads((folders[current] / "pyproject.toml").read_text())["project"]
            reqs = [Requirement(r) for r in project.get("dependencies", [])]
        else:
            reqs = [Requirement(r) for r in importlib.metadata.requires(current) or []]
        todo += [
            _normal(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return seen


def _pinned(name: str) -> dict[str, str]:
    pinned = {}
    for line in (REPO / "images" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, _, version = line.partition("==")
            assert version, f"not pinned: {line}"
            pinned[_normal(package)] = version
    return pinned


def _installed_here(containerfile: str, stage: str) -> list[str]:
    """The folders a venv stage's install-product call installs."""
    found = re.findall(r"^FROM \S+ AS ([\w-]+)\n(.*?)(?=^FROM |\Z)", containerfile, re.M | re.S)
    stages = dict(found)
    call = re.search(r"install-product \S+ /src((?:\s|\\\n)+[^&]+)", stages[stage])
    assert call, f"{stage} runs no install-product"
    return call.group(1).replace("\\\n", " ").split()


@pytest.mark.parametrize(
    ("stage", "pins", "top"),
    [
        ("venv-agent", "requirements-agent.txt", "kpx-agent"),
        ("venv-operator", "requirements-operator.txt", "kpx-operator"),
    ],
)
def test_each_image_pins_exactly_what_its_distributions_require(
    stage: str, pins: str, top: str
) -> None:
    """An image's venv holds its distributions (and those they require from the tree) and the
    third-party closure of their requirements, every package pinned and nothing else."""
    closure = _closure(top)
    ours = {d for d in closure if d in _workspace()}
    text = (REPO / images.CONTAINERFILE).read_text()
    folders = {_normal(n): f.relative_to(REPO).as_posix() for n, f in _workspace().items()}
    assert sorted(_installed_here(text, stage)) == sorted(folders[d] for d in ours)
    assert f"-r /src/images/{pins}" in text
    pinned = _pinned(pins)
    third_party = closure - ours
    assert pinned.keys() == third_party, (
        f"{pins}: missing {sorted(third_party - pinned.keys())}, "
        f"extra {sorted(pinned.keys() - third_party)}"
    )
    for package, version in pinned.items():  # the versions the tests run against
        assert importlib.metadata.version(package) == version, package


def test_the_operator_image_carries_none_of_the_agents_dataplane() -> None:
    operator, agent = _pinned("requirements-operator.txt"), _pinned("requirements-agent.txt")
    assert "kopf" in operator and "kopf" not in agent
    for package in ("grpcio", "protobuf", "pyroute2", "prometheus-client"):
        assert package in agent and package not in operator, package
    # Nothing only the harness needs.
    assert not {"cryptography", "jinja2"} & (agent.keys() | operator.keys())


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
