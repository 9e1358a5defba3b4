"""The IPVS guest's kernel tests, run beside the rest of the session.

The guest (test_ipvs_in_vm.py) emulates its CPU: booting it and running the ipvs kernel tests
in it takes 6-9 minutes, nearly all of it waiting on the guest. When a session selects
`test_ipvs_kernel_tests_pass_in_the_guest`, conftest.py starts that run in a thread as soon as
collection ends, moves test_ipvs_in_vm.py's tests to the end of the session, and the test then
reads the run's outcome; the guest stays up for the module's other tests. A session that does
not select it (or cannot run a guest) starts nothing, and the test runs the guest itself.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from kpx_cluster.vm import image as vm_image
from kpx_cluster.vm.machine import Guest

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests/e2e/test_ipvs_in_vm.py"
KERNEL_TEST = f"{MODULE}::test_ipvs_kernel_tests_pass_in_the_guest"
KERNEL_TESTS = ("tests/e2e/test_ipvs_kernel.py", "tests/e2e/test_ipvs_semantics_matrix.py")


def cannot_run() -> str | None:
    """Why no guest can run here (None: it can)."""
    if os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None:
        return "proxy-vm needs root and qemu-system-x86_64 (make setup-vm installs it)"
    missing = vm_image.missing_host_tools()
    if missing:
        return f"proxy-vm needs {', '.join(missing)} (make setup-vm installs them)"
    return None


def run_in_guest(guest: Guest, argv: list[str]) -> tuple[int, str]:
    chunks: list[bytes] = []
    code = guest.exec(argv, cwd=REPO, on_output=lambda _channel, data: chunks.append(data))
    return code, b"".join(chunks).decode(errors="replace")


def expected_tests() -> int:
    """Test functions of the kernel test files (parametrized ones count once)."""
    return sum(
        len(re.findall(r"^def test_\w+\(", (REPO / path).read_text(), re.MULTILINE))
        for path in KERNEL_TESTS
    )


def run_kernel_tests(guest: Guest) -> tuple[int, str]:
    """One guest pytest run for both files: a Python start that imports the project costs
    about 10 s under emulation, once instead of once per test function."""
    return run_in_guest(
        guest,
        [
            "python3",
            "-m",
            "pytest",
            *KERNEL_TESTS,
            "-q",
            "-p",
            "no:cacheprovider",
            "-rsx",
            "-o",
            "addopts=",
            "--timeout=600",
            "--durations=15",
        ],
    )


@dataclass
class Outcome:
    code: int = -1
    output: str = ""
    error: BaseException | None = None


class BackgroundRun:
    """Boots a guest and runs the kernel tests in a thread; `wait` gives the outcome."""

    def __init__(self) -> None:
        self.guest = Guest(f"pytest-bg-{os.getpid()}")
        self.outcome = Outcome()
        self._thread = threading.Thread(target=self._run, name="ipvs-guest", daemon=True)
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.guest.up()
            with self._lock:
                if self._stopped:  # the session ended while the guest booted
                    self.guest.down()
                    return
            self.outcome.code, self.outcome.output = run_kernel_tests(self.guest)
        except BaseException as exc:  # reported by the test that waits for it
            self.outcome.error = exc

    def wait(self, timeout: float) -> Outcome:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.outcome.error = TimeoutError(f"the guest's kernel tests ran over {timeout:.0f} s")
        return self.outcome

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self.guest.down()


#: The session's background run, when conftest.py started one.
current: BackgroundRun | None = None
