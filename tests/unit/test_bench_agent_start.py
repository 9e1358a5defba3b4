"""How the benchmarks start a kpx agent: from bytecode compiled as the image compiles it, with
the module the `proxy-agent` command runs (or a tree's CLI module from before it)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import compare  # noqa: E402


def _tree(root: Path, entry: bool) -> Path:
    for d in benchlib.AGENT_SOURCE_DIRS:
        (root / d / "pkg").mkdir(parents=True)
        (root / d / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "agents" / "kpx_agent").mkdir()
    if entry:
        (root / "agents" / "kpx_agent" / "__main__.py").write_text("")
    return root


def test_the_agents_sources_are_compiled_once(tmp_path: Path) -> None:
    tree = _tree(tmp_path, entry=True)
    benchlib.compile_agent_sources(tree)
    for d in benchlib.AGENT_SOURCE_DIRS:
        assert list((tree / d / "pkg" / "__pycache__").glob("mod.*.pyc")), d
    # once per tree and process: a second call compiles nothing (a new module stays so)
    (tree / "agents" / "pkg" / "later.py").write_text("Y = 2\n")
    benchlib.compile_agent_sources(tree)
    assert not list((tree / "agents" / "pkg" / "__pycache__").glob("later.*.pyc"))


def test_agent_module_follows_the_tree(tmp_path: Path) -> None:
    assert compare.agent_module(_tree(tmp_path / "new", entry=True)) == "kpx_agent"
    assert compare.agent_module(_tree(tmp_path / "old", entry=False)) == "kpx_agent.cli"
    assert compare.agent_module(None) == "kpx_agent.cli"


def test_this_trees_kpx_agent_is_the_one_the_bench_starts() -> None:
    tree = compare.Dataplane(compare.KPX, "nftables").source_tree()
    assert tree is not None and (tree / "agents" / "kpx_agent" / "__main__.py").exists()
    assert compare.Dataplane(compare.KUBE_PROXY, "nftables").source_tree() is None
