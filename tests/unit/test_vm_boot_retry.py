"""A guest boot that hangs is killed and booted again (a rare early-kernel hang under
emulation must not fail the run), and after the last try the error names the kept consoles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kpx_cluster.vm import machine
from kpx_cluster.vm.machine import Guest, VMError


def test_a_boot_that_never_answers_is_killed_and_returns_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest = Guest("unit-boot")
    guest_dir = tmp_path / "vm"
    guest_dir.mkdir()
    monkeypatch.setattr(Guest, "state_dir", property(lambda _s: guest_dir))
    ok = guest._boot(["sleep", "60"], timeout=1.0)
    assert ok is False
    assert guest.pid() is None  # the hung qemu is gone and its pid file removed
    assert (guest_dir / "console.log").exists()


def test_up_retries_then_names_every_console(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest_dir = tmp_path / "vm"
    monkeypatch.setattr(Guest, "state_dir", property(lambda _s: guest_dir))
    monkeypatch.setattr(machine.vm_image, "build", lambda: _Image(tmp_path))
    monkeypatch.setattr(machine, "default_shares", lambda: [])
    monkeypatch.setattr(machine, "QEMU_BASE", ("sh", "-c", "echo booting; exec sleep 60", "qemu"))
    monkeypatch.setattr(machine, "BOOT_ATTEMPT_TIMEOUT", 0.5)
    tries: list[str] = []
    with pytest.raises(VMError, match="did not come up in 3 boots"):
        Guest("unit-retry").up(log=tries.append)
    assert sum("booting guest" in m for m in tries) == machine.BOOT_ATTEMPTS
    kept = sorted(p.name for p in guest_dir.glob("console.try*.log"))
    assert kept == ["console.try1.log", "console.try2.log", "console.try3.log"]
    assert (guest_dir / "console.try2.log").read_text() == "booting\n"
    assert not any(_alive(p) for p in _pids(guest_dir))


def test_down_removes_the_consoles_of_the_tries_that_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guest_dir = tmp_path / "vm"
    guest_dir.mkdir()
    monkeypatch.setattr(Guest, "state_dir", property(lambda _s: guest_dir))
    for name in ("console.log", "console.try1.log", "console.try2.log"):
        (guest_dir / name).write_text("booting\n")
    Guest("unit-down").down(keep_console=True)
    assert sorted(p.name for p in guest_dir.iterdir()) == [
        "console.log",
        "console.try1.log",
        "console.try2.log",
    ]
    Guest("unit-down").down()
    assert not guest_dir.exists()


class _Image:
    def __init__(self, root: Path) -> None:
        self.kernel = root / "vmlinuz"
        self.initrd = root / "initrd"
        self.root = root / "root.img"


def _pids(guest_dir: Path) -> list[int]:
    pid_file = guest_dir / "pid"
    return [int(pid_file.read_text())] if pid_file.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
