"""README: "A second `make setup` installs and builds nothing". The Go build targets of `make
setup` run here against an empty cache with a stand-in `go` that records each call and "builds" by
writing the file it is asked for: the first run builds every binary, the second calls `go` for
nothing and says `cached:` for each. (setup-apt checks `dpkg -s` per package, setup-python and
setup-vm have their own checks; they change the machine, so they are not run here.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GO_TARGETS = (
    "setup-kubernetes",
    "setup-helm",
    "setup-kstatus",
    "setup-coredns",
    "setup-go-localstate",
)

FAKE_GO = """#!/bin/sh
echo "$*" >> "$FAKE_GO_LOG"
case "$1" in
  build|test)
    out=""; prev=""
    for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
    [ -n "$out" ] && printf '#!/bin/sh\\n' > "$out" && chmod +x "$out" ;;
  list) echo v0.36.2 ;;
esac
exit 0
"""


def make(target: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        ["make", "-s", "-C", str(REPO), target],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"make {target}: {done.stdout}{done.stderr}"
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_make_setup_runs_every_go_build_target() -> None:
    makefile = (REPO / "Makefile").read_text()
    setup = re.search(r"^setup:(.*)$", makefile, re.M)
    assert setup is not None
    assert set(GO_TARGETS) <= set(setup.group(1).split())


@pytest.mark.parametrize("target", GO_TARGETS)
def test_a_second_run_builds_nothing(target: str, tmp_path: Path) -> None:
    bin_dir, log = tmp_path / "fakebin", tmp_path / "go.log"
    bin_dir.mkdir()
    (bin_dir / "go").write_text(FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PROXY_CACHE_DIR": str(tmp_path / "cache"),
        "FAKE_GO_LOG": str(log),
    }

    first = make(target, env)
    builds = [c for c in log.read_text().splitlines() if c.split()[0] in ("build", "test")]
    assert builds, f"{target} built nothing into an empty cache: {first}"
    assert not any(line.startswith("cached:") for line in first)

    log.write_text("")
    second = make(target, env)
    assert log.read_text() == "", f"{target} ran go again: {log.read_text()}"
    said = [line for line in second if not line.startswith("toolchain/")]  # make's echo
    assert said and all(line.startswith("cached: ") for line in said), second
    assert len(said) == len(builds)  # one `cached:` per binary the first run built
