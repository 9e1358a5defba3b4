"""The suite's own layout: pytest imports test modules by basename (rootdir-relative, no
packages), so two test files with one name in different tiers stop the whole run at collection."""

from __future__ import annotations

import ast
import re
import tomllib
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_tiers() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if ".venv" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    clashes.pop("__init__.py", None)
    clashes.pop("conftest.py", None)
    assert not clashes, f"test modules sharing a name: {clashes}"


# The three tiers the README names: tests/unit (pure), the kernel tier (`netns`: root and
# network namespaces, no apiserver) and the cluster tier (`e2e`: a real kube-apiserver and
# etcd, often with netns too). `make test-kernel` and `make test-e2e` select by these markers,
# so a file in tests/e2e without one runs in neither.
TIERS = {"e2e", "netns"}


def module_marks(path: Path, seen: frozenset[Path] = frozenset()) -> set[str]:
    """The `pytest.mark.<name>` names in `path`'s module-level `pytestmark`, following
    `from <sibling test module> import pytestmark`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks |= {
                sub.attr
                for sub in ast.walk(node.value)
                if isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "mark"
            }
        elif isinstance(node, ast.ImportFrom) and any(
            alias.name == "pytestmark" for alias in node.names
        ):
            source = path.parent / f"{node.module}.py"
            assert source not in seen, f"{path.name}: pytestmark imports form a cycle"
            marks |= module_marks(source, seen | {path})
    return marks


def test_every_e2e_file_names_its_tier_in_pytestmark() -> None:
    untiered = {
        path.name: sorted(module_marks(path))
        for path in sorted((TESTS / "e2e").glob("test_*.py"))
        if not module_marks(path) & TIERS
    }
    assert not untiered, f"tests/e2e files without an e2e or netns pytestmark: {untiered}"


def test_module_marks_reads_lists_single_marks_and_imported_marks(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(
        "import pytest\npytestmark = [pytest.mark.netns, pytest.mark.skipif(True, reason='x')]\n"
    )
    (tmp_path / "test_b.py").write_text("from test_a import pytestmark\n")
    (tmp_path / "test_c.py").write_text("import pytest\npytestmark = pytest.mark.e2e\n")
    (tmp_path / "test_d.py").write_text("import pytest\n\n@pytest.mark.e2e\ndef test_x(): ...\n")
    assert module_marks(tmp_path / "test_a.py") == {"netns", "skipif"}
    assert module_marks(tmp_path / "test_b.py") == {"netns", "skipif"}
    assert module_marks(tmp_path / "test_c.py") == {"e2e"}
    assert module_marks(tmp_path / "test_d.py") == set()


def test_the_tier_markers_are_registered() -> None:
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":", 1)[0] for m in markers} >= TIERS


def test_the_makefile_runs_each_tier_alone() -> None:
    makefile = (TESTS.parent / "Makefile").read_text()
    assert re.search(r"^test-unit:.*\n\t.*pytest tests/unit", makefile, re.M)
    kernel = r"^test-kernel:.*\n\t.*pytest tests/e2e -m \"netns and not e2e\""
    assert re.search(kernel, makefile, re.M)
    assert re.search(r"^test-e2e:.*\n\t.*pytest tests/e2e -m e2e\b", makefile, re.M)


def test_make_test_leaves_out_only_the_long_runs_and_test_long_runs_them() -> None:
    makefile = (TESTS.parent / "Makefile").read_text()
    assert re.search(r"^test:.*\n\t.*pytest -m \"not long\"$", makefile, re.M)
    assert re.search(r"^test-long:.*\n\t.*pytest -m long$", makefile, re.M)
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("long:") for m in markers)
