"""The images `make image` builds, run under runc as a kubelet would run their pods.

Each test unpacks an image once (shared, read-only) and runs a container from it with the
securityContext the operator (or the shipped manifests) give it, inside a network namespace
the test creates: the agent's tools and capabilities are enough and minimal (without NET_ADMIN
it cannot touch the node's rules), and the operator runs as non-root on a read-only root.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import Mode
from kpx_cluster import images, oci
from kpx_cluster.netns import Node, Topology
from kpx_operator import builders

pytestmark = [pytest.mark.netns]
REPO = Path(__file__).resolve().parents[2]
OPERATOR, AGENT = images.images(images.project_version())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> oci.ImageStore:
    directory = images.archives_dir()
    if images.missing(directory=directory):
        pytest.fail("the images are missing or stale: run `make image`", pytrace=False)
    store = oci.ImageStore(directory / "rootfs")
    for image in (OPERATOR, AGENT):
        store.load(image.archive(directory))
    store.prune()  # the root filesystems of earlier builds
    return store


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Topology, Node]]:
    with Topology() as topo:
        yield topo, topo.add_node("img")


def run(
    store: oci.ImageStore,
    tmp_path: Path,
    ref: str,
    sc: dict[str, Any],
    *,
    pod_sc: dict[str, Any] | None = None,
    command: list[str] | None = None,
    args: list[str] | None = None,
    netns: str | None = None,
) -> subprocess.CompletedProcess[str]:
    image = store.unpack(ref)
    spec = oci.runtime_spec(
        image.rootfs,
        oci.process_args(image.config, command or [], args or []),
        {},
        image.config,
        oci.SecurityContext.from_pod(pod_sc or {}, sc),
        netns=netns,
    )
    cid = f"kpx-test-{secrets.token_hex(4)}"
    return oci.run(oci.Bundle(tmp_path / cid, spec), cid)


def netns_path(node: Node) -> str:
    return f"/var/run/netns/{node.netns}"


def test_archives_name_their_images_and_entry_points() -> None:
    for image, entrypoint, user in (
        (OPERATOR, ["proxy-operator"], "65532:65532"),
        (AGENT, ["proxy-agent"], ""),
    ):
        archive = image.archive(images.archives_dir())
        assert oci.archive_refs(archive).keys() == {image.ref}
        out = subprocess.run(
            ["skopeo", "inspect", "--config", f"oci-archive:{archive}"],
            capture_output=True,
            text=True,
            check=True,
        )
        config = json.loads(out.stdout)["config"]
        assert config["Entrypoint"] == entrypoint
        assert config.get("User", "") == user


def test_agent_cleans_its_rules_with_net_admin_and_cannot_without(
    store: oci.ImageStore, node: tuple[Topology, Node], tmp_path: Path
) -> None:
    """The agent's own securityContext (drop ALL, add NET_ADMIN, RuntimeDefault seccomp) is
    enough for `proxy-agent cleanup --mode nftables` in the node's netns; without NET_ADMIN
    the same container fails and the rules stay."""
    topo, n = node
    sc = builders._security_context(Mode.NFTABLES)
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    topo.exec(n, ["nft", "add", "table", "ip", "kpx"], check=True)

    def has_table() -> bool:
        return " kpx" in topo.exec(n, ["nft", "list", "tables"], check=True).stdout

    without = {**sc, "capabilities": {"drop": ["ALL"]}}
    out = run(
        store,
        tmp_path,
        AGENT.ref,
        without,
        args=["cleanup", "--mode", "nftables"],
        netns=netns_path(n),
    )
    assert out.returncode != 0, out.stdout
    assert "Operation not permitted" in out.stderr, out.stderr
    assert has_table(), "the rules went away without NET_ADMIN"

    out = run(
        store, tmp_path, AGENT.ref, sc, args=["cleanup", "--mode", "nftables"], netns=netns_path(n)
    )
    assert out.returncode == 0, out.stderr
    assert "removed the nftables rules of kpx" in out.stdout
    assert not has_table()


@pytest.mark.parametrize("variant", ["legacy", "nft"])
def test_iptables_wrapper_follows_the_rules_in_use(
    store: oci.ImageStore, tmp_path: Path, variant: str
) -> None:
    """iptables in the agent image is the wrapper: it picks the variant whose rules the node
    has (KUBE- chains first), as upstream's iptables-wrapper does; nft on an empty node."""
    sc = builders._security_context(Mode.IPTABLES)
    with Topology() as topo:
        n = topo.add_node("ipt")
        if variant == "legacy":
            topo.exec(
                n, ["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"], check=True
            )
        try:
            out = run(
                store,
                tmp_path,
                AGENT.ref,
                sc,
                command=["iptables", "--version"],
                netns=netns_path(n),
            )
        finally:
            if variant == "legacy":
                topo.exec(n, ["iptables-legacy", "-t", "mangle", "-X", "KUBE-IPTABLES-HINT"])
    assert out.returncode == 0, out.stderr
    expected = "(legacy)" if variant == "legacy" else "(nf_tables)"
    assert expected in out.stdout, out.stdout


def test_operator_runs_non_root_on_a_read_only_root(store: oci.ImageStore, tmp_path: Path) -> None:
    """The shipped Deployment's securityContext: runAsNonRoot, uid 65532, read-only root,
    every capability dropped; the operator starts (--help) and cannot write its image."""
    deployment = yaml.safe_load((REPO / "operator/manifests/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    out = run(store, tmp_path, OPERATOR.ref, sc, pod_sc=pod["securityContext"], args=["--help"])
    assert out.returncode == 0, out.stderr
    assert "usage: proxy-operator" in out.stdout
    probe = "id -u; touch /opt/kpx/x 2>/dev/null && echo writable || echo read-only"
    out = run(
        store,
        tmp_path,
        OPERATOR.ref,
        sc,
        pod_sc=pod["securityContext"],
        command=["sh", "-c", probe],
    )
    assert out.stdout.split() == ["65532", "read-only"], out.stdout + out.stderr
    # Root is refused by the runtime before anything runs.
    with pytest.raises(oci.SecurityError, match="runAsNonRoot"):
        run(store, tmp_path, OPERATOR.ref, sc, pod_sc={**pod["securityContext"], "runAsUser": 0})


def test_the_agent_image_converts_kube_proxys_configuration(
    store: oci.ImageStore, tmp_path: Path
) -> None:
    """docs/install.md runs the converter from the agent image (its entrypoint is proxy-agent)."""
    sc = builders._security_context(Mode.NFTABLES)
    out = run(store, tmp_path, AGENT.ref, sc, args=["convert-kube-proxy-config", "--help"])
    assert out.returncode == 0, out.stderr
    assert "usage: proxy-agent convert-kube-proxy-config" in out.stdout
    assert "--takeover" in out.stdout
