"""The suite's own layout: pytest imports test modules by basename (rootdir-relative, no
packages), so two test files with one name in different tiers stop the whole run at collection."""

from __future__ import annotations

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
