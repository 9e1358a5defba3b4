"""Runs the IPVS kernel tests inside a `proxy-vm` guest (this host's kernel has no IPVS).

Skipped, saying why, only where qemu cannot run (not installed, or not root); a failure or a
skip inside the guest fails here. The guest image is built on first use (minutes, cached in
~/.cache/kpx/vm/); `make setup-vm` builds it ahead.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpx_cluster.vm import image as vm_image
from kpx_cluster.vm.machine import Guest

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = "tests/e2e/test_ipvs_kernel.py"
#: One guest pytest run per test function (each within the per-test timeout).
GUEST_TESTS = re.findall(r"^def (test_\w+)\(", (REPO / KERNEL_TESTS).read_text(), re.MULTILINE)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None,
    reason="proxy-vm needs root and qemu-system-x86_64 (make setup-vm installs it)",
)


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    missing = vm_image.missing_host_tools()
    if missing:
        pytest.skip(f"proxy-vm needs {', '.join(missing)} (make setup-vm installs them)")
    vm = Guest(f"pytest-{os.getpid()}")
    vm.up()
    try:
        yield vm
    finally:
        vm.down()


def run_in_guest(guest: Guest, argv: list[str]) -> tuple[int, str]:
    chunks: list[bytes] = []
    code = guest.exec(argv, cwd=REPO, on_output=lambda _channel, data: chunks.append(data))
    return code, b"".join(chunks).decode(errors="replace")


def test_guest_has_ipvs_and_the_tools(guest: Guest) -> None:
    code, out = run_in_guest(
        guest,
        ["sh", "-c", "ipvsadm -Ln >/dev/null && nft --version && conntrack --version && "
         "ip netns add t && ip netns del t && python3 -c 'import pyroute2, pydantic' && "
         "uname -r && echo $KPX_PROBE"],
    )  # fmt: skip
    assert code == 0, out
    assert "-amd64" in out


@pytest.mark.parametrize("name", GUEST_TESTS)
def test_ipvs_kernel_tests_pass_in_the_guest(guest: Guest, name: str) -> None:
    code, out = run_in_guest(
        guest,
        ["python3", "-m", "pytest", f"{KERNEL_TESTS}::{name}", "-q", "-p", "no:cacheprovider",
         "-rsx"],
    )  # fmt: skip
    assert code == 0, out[-6000:]
    assert " skipped" not in out, out[-3000:]
