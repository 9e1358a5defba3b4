"""docs/install.md's commands, as a user would copy them: every `helm install` renders with the
pinned helm and the chart's schema (its `--set` keys exist); the files they name are in the
repository; the namespace is created with its Pod Security label before the chart goes in; an
existing kubeadm cluster is taken over (`spec.takeover`, from the converted kube-proxy
ConfigMap) with the images from the user's registry; the way back to kube-proxy is a valid
patch; the ports paragraph says what the agent does (kube-proxy's ports, its bind retry) and
never names kube-scheduler's 10259."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import CHART, NAMESPACE, helm_binary

from kpx_agent.cli import main
from kpx_agent.observability.http_endpoints import BIND_RETRY
from kpx_api.proxyconfiguration import DeletionPolicy
from kpx_api.proxysettings import ProxySettings

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "install.md"
KUBEADM = Path(__file__).parent / "kube_proxy_configs" / "kubeadm-v1.36-kube-proxy-configmap.yaml"
#: What the shell variables of the recipes stand for here.
VARIABLES = {"$REGISTRY": "registry.example.com/kpx", "$API": "192.0.2.10", "$HOME": "/root"}
EXISTING = "## Replace kube-proxy on a kubeadm cluster"


def sh_commands(text: str) -> Iterator[list[str]]:
    """Each command of the ```sh blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"^\s*```sh\n(.*?)^\s*```", text, re.S | re.M):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                yield words


def substituted(words: list[str]) -> list[str]:
    out = []
    for word in words:
        for name, value in VARIABLES.items():
            word = word.replace(name, value)
        out.append(word)
    return out


def helm_installs(text: str) -> list[list[str]]:
    return [substituted(w) for w in sh_commands(text) if w[:2] == ["helm", "install"]]


def test_the_doc_has_its_recipes() -> None:
    """Not vacuous: the parser finds the recipes' commands."""
    text = DOC.read_text()
    assert len(helm_installs(text)) == 3  # kind, a new kubeadm cluster, an existing one
    assert EXISTING in text


def test_every_helm_install_renders(tmp_path: Path) -> None:
    """`helm install` as `helm template`: the chart's schema accepts every `--set` (an unknown
    key or a bad value fails, naming it)."""
    for words in helm_installs(DOC.read_text()):
        release, chart, *flags = words[2:]
        assert chart == "charts/kpx", words
        run = subprocess.run(
            [str(helm_binary()), "template", release, str(CHART), *flags],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                "HELM_CONFIG_HOME": str(tmp_path),
                "HELM_CACHE_HOME": str(tmp_path),
                "HELM_DATA_HOME": str(tmp_path),
                "PATH": "/usr/bin:/bin",
            },
        )
        assert run.returncode == 0, f"{shlex.join(words)}:\n{run.stderr}"
        objs = [o for o in yaml.safe_load_all(run.stdout) if o]
        (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
        assert deployment["metadata"]["namespace"] == NAMESPACE


def test_the_kubeadm_recipes_use_the_users_registry(tmp_path: Path) -> None:
    """Both kubeadm recipes set the operator's and the agents' image repositories."""
    kubeadm = DOC.read_text().split(EXISTING, 1)[1]
    installs = helm_installs(kubeadm)
    assert len(installs) == 2
    for words in installs:
        sets = {words[i + 1] for i, w in enumerate(words) if w == "--set"}
        assert f"operator.image.repository={VARIABLES['$REGISTRY']}/kpx-operator" in sets
        assert f"operator.agentImage.repository={VARIABLES['$REGISTRY']}/kpx-agent" in sets


def test_the_files_the_commands_name_are_in_the_repository() -> None:
    paths = [
        word
        for words in sh_commands(DOC.read_text())
        for word in words
        if re.match(r"(charts|crds|examples|operator)/", word)
    ]
    assert "charts/kpx" in paths
    assert [p for p in paths if not (REPO / p).exists()] == []


def test_the_namespace_and_its_pod_security_label_come_before_the_chart() -> None:
    """Each recipe creates kpx-system and labels it privileged (hostNetwork, NET_ADMIN) before
    its `helm install` (the new-cluster recipe runs the existing one's steps 1 and 2 first)."""
    text = DOC.read_text()
    kind, kubeadm = text.split(EXISTING, 1)
    for recipe in (kind, kubeadm.split("**Existing cluster**", 1)[1]):
        commands = [shlex.join(w) for w in sh_commands(recipe)]
        install = next(i for i, c in enumerate(commands) if c.startswith("helm install"))
        before = commands[:install]
        assert f"kubectl create namespace {NAMESPACE}" in before, before
        assert (
            f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged"
        ) in before
    assert "steps 1 and 2 below" in kubeadm.split("**Existing cluster**", 1)[0]


def test_an_existing_cluster_is_taken_over_not_cut_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The existing-cluster recipe converts kubeadm's ConfigMap with --takeover (run here on
    kubeadm v1.36's default ConfigMap, with the doc's flags) and deletes no kube-proxy before
    kpx serves the nodes."""
    existing = DOC.read_text().split("**Existing cluster**", 1)[1]
    (convert,) = [
        w for w in sh_commands(existing) if w[:2] == ["proxy-agent", "convert-kube-proxy-config"]
    ]
    flags = [w for w in convert[2:] if w.startswith("--")]
    assert "--takeover" in flags
    code = main(["convert-kube-proxy-config", *flags, str(KUBEADM)])
    out, err = capsys.readouterr()
    assert code in (0, 1), err  # 1: NOT CARRIED lines the doc explains
    spec = yaml.safe_load(out)["spec"]
    assert spec["takeover"] == {"fromKubeProxy": True, "moveKubeProxyOff": True}
    steps = existing.split("6. **Later kubeadm upgrades**", 1)[0]
    deletes = [shlex.join(w) for w in sh_commands(steps) if w[:1] == ["kubectl"] and "delete" in w]
    assert deletes == []


def test_the_way_back_to_kube_proxy_is_a_valid_patch() -> None:
    text = DOC.read_text()
    assert "**Going back to kube-proxy.**" in text
    back = text.split("**Going back to kube-proxy.**", 1)[1].split("**Ports.**", 1)[0]
    commands = list(sh_commands(back))
    (patch,) = [w for w in commands if w[:2] == ["kubectl", "patch"]]
    body: dict[str, Any] = json.loads(patch[patch.index("-p") + 1])
    assert DeletionPolicy(body["spec"]["deletionPolicy"]) is DeletionPolicy.CLEANUP
    assert commands[1][:4] == ["kubectl", "delete", "pxc", "default"]
    assert commands[2][:3] == ["helm", "uninstall", "kpx"]


def test_the_ports_paragraph_says_what_the_agent_does() -> None:
    text = DOC.read_text()
    assert "10259" not in text  # kube-scheduler's port
    ports = " ".join(text.split("**Ports.**", 1)[1].split())
    defaults = {name: field.default for name, field in ProxySettings.model_fields.items()}
    assert f"`healthzBindAddress` (default `{defaults['healthz_bind_address']}`" in ports
    assert f"`metricsBindAddress` (default `{defaults['metrics_bind_address']}`" in ports
    assert f"retries binding every {BIND_RETRY:.0f} s" in ports
