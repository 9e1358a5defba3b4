"""Runs the IPVS kernel tests inside a `proxy-vm` guest (this host's kernel has no IPVS):
tests/e2e/test_ipvs_kernel.py, the ipvs column of the semantics matrix
(tests/e2e/test_ipvs_semantics_matrix.py), the ipvs example (test_ipvs_example_kernel.py) and
the ipvs -> nftables switch under load (test_ipvs_to_nftables_under_load.py; those two reach
the session's local control plane through the kubeconfig, which proxy-vm relays).

In a session that selects the kernel tests, they run in a guest booted when collection ends,
beside the session's other tests, and this module's tests run last (guest_background.py,
conftest.py): the emulated guest's 6-9 minutes overlap the rest instead of adding to it.

Skipped, saying why, only where qemu cannot run (not installed, or not root); a failure or a
skip inside the guest fails here. The guest image is built on first use (minutes, cached in
~/.cache/kpx/vm/); `make setup-vm` builds it ahead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import guest_background
import pytest
import yaml
from guest_background import run_in_guest

from kpx_api import ProxyConfiguration
from kpx_cluster.controlplane import Cluster
from kpx_cluster.vm.machine import Guest
from kpx_operator.builders import BuildOptions, Owner, agent_children
from kpx_operator.names import AGENT_SERVICE_ACCOUNT

REPO = Path(__file__).resolve().parents[2]
GUEST_TIMEOUT = 1500

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.netns,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("qemu-system-x86_64") is None,
        reason="proxy-vm needs root and qemu-system-x86_64 (make setup-vm installs it)",
    ),
]


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    """The session's background guest once its kernel tests are done (guest_background.py),
    or one booted here when the session started none."""
    background = guest_background.current
    if background is not None:
        if background.wait(GUEST_TIMEOUT).error is None:
            yield background.guest
            return
        background.stop()  # the kernel test reports why; the others get a guest of their own
    why = guest_background.cannot_run()
    if why is not None:
        pytest.skip(why)
    vm = Guest(f"pytest-{os.getpid()}")
    vm.up()
    try:
        yield vm
    finally:
        vm.down()


@pytest.mark.timeout(GUEST_TIMEOUT)  # its setup may wait for the background run
def test_guest_has_ipvs_and_the_tools(guest: Guest) -> None:
    code, out = run_in_guest(
        guest,
        [
            "sh",
            "-c",
            "ipvsadm -Ln >/dev/null && nft --version && conntrack --version && "
            "ip netns add t && ip netns del t && python3 -c 'import pyroute2, pydantic' && "
            "uname -r && echo $KPX_PROBE",
        ],
    )
    assert code == 0, out
    assert "-amd64" in out


@pytest.mark.timeout(GUEST_TIMEOUT)
def test_ipvs_kernel_tests_pass_in_the_guest(guest: Guest) -> None:
    background = guest_background.current
    if background is not None and background.outcome.error is not None:
        pytest.fail(f"the guest's background run failed: {background.outcome.error!r}")
    if background is not None and background.guest is guest:
        outcome = background.outcome  # run while the session's other tests ran
        code, out = outcome.code, outcome.output
    else:
        code, out = guest_background.run_kernel_tests(guest)
    print(out[-4000:])  # the guest's own summary and slowest tests, for the CI log
    assert code == 0, out[-6000:]
    assert " skipped" not in out, out[-3000:]
    # Every test function ran (parametrized ones count once or more).
    passed = re.search(r"(\d+) passed", out)
    expected = guest_background.expected_tests()
    assert passed is not None and int(passed.group(1)) >= expected, out[-3000:]


EXAMPLE = REPO / "examples" / "proxyconfig-ipvs.yaml"
EXAMPLE_TEST = "tests/e2e/test_ipvs_example_kernel.py"
MANIFESTS = REPO / "operator" / "manifests"


def _agent_identity(cluster: Cluster) -> tuple[list[str], list[dict[str, object]]]:
    """The agents' ServiceAccount and RBAC as installed with the operator; returns a token
    and the objects this test created (to delete after: a later install owns them)."""
    docs = [
        d
        for f in ("namespace.yaml", "serviceaccount.yaml", "agent-rbac.yaml")
        for d in yaml.safe_load_all((MANIFESTS / f).read_text())
        if d
    ]
    docs = [
        d
        for d in docs
        if d["kind"] != "ServiceAccount" or d["metadata"]["name"] == AGENT_SERVICE_ACCOUNT
    ]
    created = []
    for doc in docs:
        meta = doc["metadata"]
        where = ["-n", meta["namespace"]] if "namespace" in meta else []
        found = cluster.kubectl("get", doc["kind"], meta["name"], *where, check=False)
        if found.returncode != 0:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
            if doc["kind"] != "Namespace":
                created.append(doc)
    token = cluster.kubectl(
        "create", "token", AGENT_SERVICE_ACCOUNT, "-n", "kpx-system", "--duration=1h"
    ).stdout.strip()
    return [token], created


def test_the_ipvs_example_deploys_agents_that_proxy_traffic(cluster: Cluster, guest: Guest) -> None:
    """The operator's rendering of examples/proxyconfig-ipvs.yaml (ConfigMap, DaemonSet) runs
    in the guest as the DaemonSet's pod would (tests/e2e/test_ipvs_example_kernel.py)."""
    pxc = ProxyConfiguration.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    opts = BuildOptions(apiserver_endpoint=f"127.0.0.1:{cluster.apiserver_port}")
    config_map, daemonset = agent_children(Owner(pxc.metadata["name"], "uid-1"), pxc.spec, opts)
    work = Path("/dev/shm/kpx") / f"ipvs-example-{os.getpid()}"  # shared with the guest
    shutil.rmtree(work, ignore_errors=True)
    files = work / "configmaps" / config_map["metadata"]["name"]
    files.mkdir(parents=True)
    for key, text in config_map["data"].items():
        (files / key).write_text(text)
    (work / "daemonset.json").write_text(json.dumps(daemonset))
    [token], created = _agent_identity(cluster)
    sa = work / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)
    shutil.copy(cluster.ca_file, sa / "ca.crt")
    try:
        code, out = run_in_guest(
            guest,
            [
                "env",
                f"KPX_IPVS_EXAMPLE_DIR={work}",
                f"KUBECONFIG={cluster.kubeconfig}",
                "python3",
                "-m",
                "pytest",
                EXAMPLE_TEST,
                "-q",
                "-p",
                "no:cacheprovider",
                "-rsx",
            ],
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for doc in reversed(created):
            meta = doc["metadata"]
            where = ["-n", meta["namespace"]] if "namespace" in meta else []
            cluster.kubectl(
                "delete", doc["kind"], meta["name"], *where, "--wait=false", check=False
            )
    assert code == 0, out[-6000:]
    assert " skipped" not in out, out[-3000:]


MIGRATION_TEST = "tests/e2e/test_ipvs_to_nftables_under_load.py"


@pytest.mark.long  # about 4-5 min under emulation: `make test-long`, not `make test`
def test_ipvs_to_nftables_under_load_in_the_guest(cluster: Cluster, guest: Guest) -> None:
    """Issue #18's proof under load for ipvs -> nftables (the guest half reaches the local
    control plane through the kubeconfig proxy-vm relays); prints its table row."""
    debug = [f"{k}={v}" for k, v in os.environ.items() if k.startswith("KPX_IPVS_MIGRATION_")]
    code, out = run_in_guest(
        guest,
        [
            "env",
            f"KUBECONFIG={cluster.kubeconfig}",
            *debug,
            "python3",
            "-m",
            "pytest",
            MIGRATION_TEST,
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-rsx",
        ],
    )
    rows = [line for line in out.splitlines() if line.startswith("| ipvs -> nftables |")]
    told = ("held ", "failures in the control window")
    print(
        "\n".join(
            line
            for line in out.splitlines()
            if line.startswith(told) or "ipvs leftovers removed" in line or "draining" in line
        )
    )
    print("\n".join(rows))
    assert code == 0, out[-6000:]
    assert " skipped" not in out, out[-3000:]
    assert rows, out[-3000:]
