"""The formatter owns the formatting (issue #25): no file opts out of `ruff format` by hand.
`make lint` runs `ruff format --check`; this test keeps the opt-outs from coming back."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_no_python_file_opts_out_of_the_formatter() -> None:
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files
    found = [
        f"{name}:{number}"
        for name in files
        if (REPO / name).is_file()
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1)
        if OPT_OUT.search(line)
    ]
    assert found == []
