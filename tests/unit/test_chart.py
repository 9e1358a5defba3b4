"""The Helm chart charts/kpx, rendered by the pinned helm (toolchain/build-helm.sh, `make setup`).

With default values the operator's objects are exactly operator/manifests (but the Namespace,
which belongs to the release, and the labels Helm charts add); the ProxyConfiguration is a
valid spec for every mode and carries only the selected mode's block; values.schema.json
rejects what it should with a message naming the value; the chart's CRD and the CRD-derived
part of its schema are what crds/ gives. helm missing is a failure, never a skip.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import kpx_operator
from kpx_api import Mode, ProxyConfigurationSpec, parse_spec
from kpx_operator.builders import DEFAULT_AGENT_IMAGE

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kpx"
MANIFESTS = REPO / "operator" / "manifests"
EXAMPLES = {
    "nftables": REPO / "examples" / "proxyconfig.yaml",
    "iptables": REPO / "examples" / "proxyconfig-iptables.yaml",
    "ipvs": REPO / "examples" / "proxyconfig-ipvs.yaml",
}
NAMESPACE = "kpx-system"
#: Labels the chart adds to every object's metadata (not to pod templates or selectors).
HELM_LABELS = {
    "app.kubernetes.io/instance": "kpx",
    "app.kubernetes.io/version": "0.1.0",
    "app.kubernetes.io/managed-by": "Helm",
    "helm.sh/chart": "kpx-0.1.0",
}
#: A setting per mode that differs from its default, to see where it lands.
MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "nftables": {"masqueradeBit": 12, "syncPeriod": "1m", "minSyncPeriod": "2s"},
    "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
    "ipvs": {"acknowledgeDeprecation": True, "scheduler": "wrr", "strictARP": True},
    "external": {"image": "example.com/backend:1", "args": ["--verbose"]},
}

Obj = dict[str, Any]

sys.path.insert(0, str(REPO / "charts"))
import sync_from_crds  # noqa: E402


def helm_version() -> str:
    go_mod = (REPO / "toolchain" / "helm" / "go.mod").read_text()
    pinned = re.search(r"^\s*(?:require\s+)?helm\.sh/helm/v3 (v\S+)$", go_mod, re.M)
    assert pinned is not None, "toolchain/helm/go.mod does not require helm.sh/helm/v3"
    return pinned.group(1)


def helm_binary() -> Path:
    """The pinned helm, built by `make setup` into the cache (like the Kubernetes binaries)."""
    cache = Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))
    path = cache / "bin" / helm_version() / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"helm {helm_version()} is not built ({path} missing): run `make setup` "
            "(or toolchain/build-helm.sh)",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's config, cache and data in a scratch directory: the tests read no user settings."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    for name in ("CONFIG", "CACHE", "DATA"):
        env[f"HELM_{name}_HOME"] = str(home / name.lower())
    return env


def helm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, env=env, timeout=60
    )


def template(
    env: dict[str, str],
    values: Obj | None = None,
    *extra: str,
    namespace: str = NAMESPACE,
) -> subprocess.CompletedProcess[str]:
    """`helm template kpx charts/kpx` with these values (as a values file) and extra args."""
    args = ["template", "kpx", str(CHART), "--namespace", namespace]
    if values is not None:
        args += ["--values", "-"]
    return subprocess.run(
        [str(helm_binary()), *args, *extra],
        input=json.dumps(values) if values is not None else None,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def render(
    env: dict[str, str], values: Obj | None = None, *extra: str, namespace: str = NAMESPACE
) -> list[Obj]:
    out = template(env, values, *extra, namespace=namespace)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def agents_values(mode: str, **common: Any) -> Obj:
    """Values that set every mode's block (only `mode`'s may be rendered) and `common`."""
    agents: Obj = {"mode": mode, **copy.deepcopy(MODE_SETTINGS)}
    if common:
        agents["common"] = common
    return {"agents": agents}


def the(objs: list[Obj], kind: str) -> Obj:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def without_helm_labels(obj: Obj) -> Obj:
    """The object with the chart's HELM_LABELS removed from its metadata (checked present)."""
    obj = copy.deepcopy(obj)
    labels = obj["metadata"]["labels"]
    assert {k: labels.pop(k, None) for k in HELM_LABELS} == HELM_LABELS, obj["metadata"]
    return obj


def manifests() -> Iterator[Obj]:
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield from (d for d in yaml.safe_load_all(path.read_text()) if d)


def key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


# ---- lint and chart metadata ---------------------------------------------------------------------


def test_helm_is_the_pinned_version(helm_env: dict[str, str]) -> None:
    out = helm(helm_env, "version", "--template", "{{ .Version }}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == helm_version()


@pytest.mark.parametrize("mode", [m.value for m in Mode])
def test_helm_lint(helm_env: dict[str, str], tmp_path: Path, mode: str) -> None:
    values = tmp_path / "values.json"
    values.write_text(json.dumps(agents_values(mode)))
    out = helm(helm_env, "lint", "--strict", str(CHART), "--values", str(values))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("kpx", "0.1.0", "0.1.0")
    assert chart["kubeVersion"] == ">=1.33.0-0"
    for dist in ("api", "agents", "operator", "harness"):  # appVersion is kpx's version
        project = (REPO / dist / "pyproject.toml").read_text()
        assert f'\nversion = "{chart["appVersion"]}"\n' in project, dist
    # The operator's own version, hence its default agent image, is the release's.
    assert kpx_operator.__version__ == chart["appVersion"]
    assert f"ghcr.io/kpx/kpx-agent:{chart['appVersion']}" == DEFAULT_AGENT_IMAGE


def test_kube_version_constraint(helm_env: dict[str, str]) -> None:
    assert template(helm_env, None, "--kube-version", "v1.33.0").returncode == 0
    out = template(helm_env, None, "--kube-version", "v1.32.9")
    assert out.returncode != 0
    assert "requires kubeVersion: >=1.33.0-0" in out.stderr, out.stderr


# ---- one source of truth: the CRD ----------------------------------------------------------------


def test_chart_crd_is_the_repos_crd() -> None:
    """charts/kpx/crds/ holds exactly crds/ (byte for byte): `make crds` writes both."""
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    repo_crds = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert chart_crds == repo_crds
    for name in repo_crds:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/kpx/crds/{name} differs from crds/{name}: run `make crds`"
        )


def test_values_schema_is_in_step_with_the_crd() -> None:
    stale = sync_from_crds.stale()
    assert not stale, "stale (run `make crds`):\n" + "\n".join(stale.values())


def test_sync_check_detects_a_stale_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crds = tmp_path / "crds"
    crds.mkdir()
    text = (REPO / "crds" / sync_from_crds.CRD_NAME).read_text()
    (crds / sync_from_crds.CRD_NAME).write_text(text.replace("default: 14", "default: 15"))
    monkeypatch.setattr(sync_from_crds, "CRDS", crds)
    assert set(sync_from_crds.stale()) == {
        CHART / "crds" / sync_from_crds.CRD_NAME,
        sync_from_crds.SCHEMA,
    }


def test_agents_values_cover_the_whole_spec() -> None:
    """Every spec field has its place in `agents` (mode, a mode's block, or common)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defs = schema["definitions"]
    agents = set(schema["properties"]["agents"]["properties"]) - {"common"}
    spec_fields = set(ProxyConfigurationSpec.model_json_schema(by_alias=True)["properties"])
    assert agents | set(defs["crd.common"]["properties"]) == spec_fields
    assert defs["crd.mode"]["enum"] == [m.value for m in Mode]


def test_values_yaml_comments_show_the_crd_defaults() -> None:
    """values.yaml lists each mode's settings, commented out, with the CRD's defaults."""
    text = (CHART / "values.yaml").read_text()
    defs = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    for mode in Mode:
        if mode is Mode.EXTERNAL:  # no default image: the whole block is a comment
            block = re.search(
                r"^  # external:\n  #   image: .*# required\n((?:  #   .*\n)+)", text, re.M
            )
            assert block is not None, "values.yaml: agents.external is not shown"
            shown = yaml.safe_load(block.group(1).replace("  #   ", ""))
            props = defs["crd.external"]["properties"]
            assert shown == {k: v["default"] for k, v in props.items() if "default" in v}
            continue
        block = re.search(rf"^  {mode}: {{}}\n((?:    # .*\n)+)", text, re.M)
        assert block is not None, f"values.yaml: agents.{mode} is not followed by its settings"
        shown = yaml.safe_load(block.group(1).replace("    # ", ""))
        props = defs[f"crd.{mode}"]["properties"]
        assert shown == {k: v["default"] for k, v in props.items()}, mode


# ---- the operator: operator/manifests, from the chart --------------------------------------------


def test_operator_objects_are_the_manifests(helm_env: dict[str, str]) -> None:
    rendered = {key(o): o for o in render(helm_env) if o["kind"] != "ProxyConfiguration"}
    expected = {key(o): o for o in manifests() if o["kind"] != "Namespace"}
    assert sorted(rendered) == sorted(expected)
    for k, obj in rendered.items():
        assert without_helm_labels(obj) == expected[k], k


def test_no_namespace_object(helm_env: dict[str, str]) -> None:
    """The namespace is the release's (helm install -n), not an object of the chart."""
    assert all(o["kind"] != "Namespace" for o in render(helm_env))


CLUSTER_SCOPED = (
    "ClusterRole", "ClusterRoleBinding", "ProxyConfiguration", "FlowSchema",
    "PriorityLevelConfiguration", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
)  # fmt: skip


def test_flow_control_can_be_left_out_or_tuned(helm_env: dict[str, str]) -> None:
    kinds = {o["kind"] for o in render(helm_env)}
    assert {"FlowSchema", "PriorityLevelConfiguration"} <= kinds
    tuned = {"flowControl": {"create": True, "nominalConcurrencyShares": 10,
                             "matchingPrecedence": 700}}  # fmt: skip
    objs = render(helm_env, tuned)
    assert the(objs, "FlowSchema")["spec"]["matchingPrecedence"] == 700
    level = the(objs, "PriorityLevelConfiguration")["spec"]["limited"]
    assert level["nominalConcurrencyShares"] == 10
    off = render(helm_env, {"flowControl": {"create": False, "nominalConcurrencyShares": 40,
                                            "matchingPrecedence": 850}})  # fmt: skip
    assert not {"FlowSchema", "PriorityLevelConfiguration"} & {o["kind"] for o in off}


def test_release_namespace_everywhere(helm_env: dict[str, str]) -> None:
    objs = render(helm_env, namespace="proxy")
    for obj in objs:
        if obj["metadata"]["name"] in ("kpx-agent-takeover", "kpx-operator-takeover"):
            # spec.takeover: the agents list kube-proxy's Pods where they are, the operator
            # patches kube-proxy's DaemonSet (moveKubeProxyOff).
            assert obj["metadata"]["namespace"] == "kube-system", key(obj)
        elif obj["metadata"]["name"] == "kpx-operator-apiserver":
            # The apiserver's addresses: the kubernetes Service's EndpointSlice.
            assert obj["metadata"]["namespace"] == "default", key(obj)
        elif obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "proxy", key(obj)
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == "proxy"
        for rule in obj["spec"]["rules"] if obj["kind"] == "FlowSchema" else []:
            for subject in rule["subjects"]:
                assert subject["serviceAccount"] == {"name": "kpx-agent", "namespace": "proxy"}
    command = the(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["proxy-operator", "--namespace", "proxy", *AGENT_IMAGE_FLAG]


AGENT_IMAGE_FLAG = ("--agent-image", "ghcr.io/kpx/kpx-agent:0.1.0")


def operator_container(objs: list[Obj]) -> Obj:
    container: Obj = the(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("policy", ["allow", "deny"])
def test_ipvs_policy_flag(helm_env: dict[str, str], policy: str) -> None:
    container = operator_container(render(helm_env, {"operator": {"ipvsPolicy": policy}}))
    assert container["command"] == [
        "proxy-operator", "--namespace", NAMESPACE, *AGENT_IMAGE_FLAG, "--ipvs-policy", policy,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "host", "port"),
    [
        ("192.0.2.10:6443", "192.0.2.10", "6443"),
        ("[2001:db8::10]:443", "2001:db8::10", "443"),
        ("api.example.com:6443", "api.example.com", "6443"),
    ],
)
def test_apiserver_endpoint(helm_env: dict[str, str], endpoint: str, host: str, port: str) -> None:
    container = operator_container(render(helm_env, {"operator": {"apiserverEndpoint": endpoint}}))
    assert container["command"][-2:] == ["--apiserver-endpoint", endpoint]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == host
    assert env["KUBERNETES_SERVICE_PORT"] == port


DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ({}, "ghcr.io/kpx/kpx-{}:0.1.0"),
        ({"tag": "0.2.0"}, "ghcr.io/kpx/kpx-{}:0.2.0"),
        ({"tag": DIGEST}, "ghcr.io/kpx/kpx-{}@" + DIGEST),
        ({"tag": "@" + DIGEST}, "ghcr.io/kpx/kpx-{}@" + DIGEST),
        ({"repository": "registry.example:5000/kpx/agent", "tag": "dev"},
         "registry.example:5000/kpx/agent:dev"),
    ],
)  # fmt: skip
def test_images_by_tag_or_digest(helm_env: dict[str, str], image: Obj, ref: str) -> None:
    """operator.image and operator.agentImage: repository:tag, or repository@sha256:... for a
    digest; the agents' image reaches the operator as --agent-image (the operator decides it,
    so a `helm upgrade` to another tag rolls the agents)."""
    values = {"operator": {"image": dict(image), "agentImage": dict(image)}}
    container = operator_container(render(helm_env, values))
    assert container["image"] == ref.format("operator")
    flag = container["command"].index("--agent-image")
    assert container["command"][flag + 1] == ref.format("agent")
    pxc = the(render(helm_env, values), "ProxyConfiguration")
    assert "image" not in pxc["spec"]  # nothing pins the agents unless the user does


def test_image_pull_secrets(helm_env: dict[str, str]) -> None:
    objs = render(helm_env, {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]})
    pod = the(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    # The operator gives them to the agents' pods.
    command = pod["containers"][0]["command"]
    assert command[-4:] == ["--image-pull-secret", "regcred", "--image-pull-secret", "mirror"]
    assert "imagePullSecrets" not in the(render(helm_env), "Deployment")["spec"]["template"]["spec"]


def test_operator_values(helm_env: dict[str, str]) -> None:
    values = {
        "operator": {
            "replicas": 3,
            "image": {"repository": "registry.example/kpx-operator", "tag": "dev"},
            "resources": {"requests": {"cpu": "10m"}},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [],
            "priorityClassName": "",
        }
    }
    deployment = the(render(helm_env, values), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert pod["containers"][0]["image"] == "registry.example/kpx-operator:dev"
    # Maps merge with the defaults (Helm's rule); null removes a default.
    assert pod["containers"][0]["resources"] == {
        "requests": {"cpu": "10m", "memory": "96Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "tolerations" not in pod
    assert "priorityClassName" not in pod


# ---- the ProxyConfiguration ----------------------------------------------------------------------


def test_default_proxyconfiguration(helm_env: dict[str, str]) -> None:
    pxc = the(render(helm_env), "ProxyConfiguration")
    assert pxc["apiVersion"] == "proxy.kpx.dev/v1alpha1"
    assert pxc["metadata"]["name"] == "default"
    assert "namespace" not in pxc["metadata"]  # cluster-scoped
    assert pxc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert without_helm_labels(pxc)["metadata"]["labels"] == {
        "app.kubernetes.io/name": "kpx",
        "app.kubernetes.io/part-of": "kpx",
    }
    assert pxc["spec"] == {"mode": "nftables", "clusterCIDRs": [], "tolerations": [
        {"operator": "Exists"}]}  # fmt: skip
    parse_spec(pxc["spec"])


@pytest.mark.parametrize("mode", [m.value for m in Mode])
def test_only_the_selected_block_is_rendered(helm_env: dict[str, str], mode: str) -> None:
    pxc = the(render(helm_env, agents_values(mode)), "ProxyConfiguration")
    spec = pxc["spec"]
    assert spec["mode"] == mode
    assert spec[mode] == MODE_SETTINGS[mode]
    assert [m for m in Mode if m.value in spec] == [mode]
    parsed = parse_spec(spec)
    assert parsed.mode == mode


@pytest.mark.parametrize("mode", list(EXAMPLES))
def test_examples_as_values(helm_env: dict[str, str], mode: str) -> None:
    """Any spec can be written as values: each example's spec is rendered back exactly."""
    example = yaml.safe_load(EXAMPLES[mode].read_text())
    spec = example["spec"]
    modes = {m.value for m in Mode}
    common = {k: v for k, v in spec.items() if k != "mode" and k not in modes}
    values = {
        "proxyConfiguration": {"name": example["metadata"]["name"]},
        "agents": {
            "mode": spec["mode"],
            spec["mode"]: spec.get(spec["mode"], {}),
            "common": common,
        },
    }
    # Left out, tolerations would get the chart's default ([{operator: Exists}]), not the CRD's.
    values["agents"]["common"].setdefault("tolerations", [])
    pxc = the(render(helm_env, values), "ProxyConfiguration")
    assert pxc["metadata"]["name"] == example["metadata"]["name"]
    assert pxc["spec"] == {**spec, "tolerations": spec.get("tolerations", [])}
    parse_spec(pxc["spec"])


def test_common_settings(helm_env: dict[str, str]) -> None:
    common = {
        "clusterCIDRs": ["10.244.0.0/16", "fd00:10:244::/56"],
        "namespaceOptOut": {"namespaces": ["legacy"]},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "resources": {"requests": {"cpu": "50m"}, "limits": {"memory": "256Mi"}},
        "image": "registry.example/kpx-agent:dev",
        "maxUnavailable": "10%",
        "priorityClassName": "system-node-critical",
    }
    spec = the(render(helm_env, agents_values("nftables", **common)), "ProxyConfiguration")["spec"]
    assert spec == {
        "mode": "nftables",
        "nftables": MODE_SETTINGS["nftables"],
        "tolerations": [{"operator": "Exists"}],
        **common,
    }
    assert parse_spec(spec).max_unavailable == "10%"


def test_proxyconfiguration_can_be_left_out(helm_env: dict[str, str]) -> None:
    objs = render(helm_env, {"proxyConfiguration": {"create": False}})
    assert "ProxyConfiguration" not in {o["kind"] for o in objs}
    assert {o["kind"] for o in objs} == {o["kind"] for o in manifests()} - {"Namespace"}


def test_keep_on_uninstall_can_be_turned_off(helm_env: dict[str, str]) -> None:
    objs = render(helm_env, {"proxyConfiguration": {"keepOnUninstall": False}})
    assert "annotations" not in the(objs, "ProxyConfiguration")["metadata"]


def test_ipvs_needs_the_acknowledgement(helm_env: dict[str, str]) -> None:
    out = template(helm_env, {"agents": {"mode": "ipvs"}})
    assert out.returncode != 0
    assert "agents.ipvs.acknowledgeDeprecation" in out.stderr, out.stderr
    assert "mode ipvs is deprecated upstream" in out.stderr


# ---- values.schema.json --------------------------------------------------------------------------


UNKNOWN = "additional properties '{}' not allowed"


@pytest.mark.parametrize(
    ("values", "where", "what"),
    [
        ({"agents": {"mode": "userspace"}}, "/agents/mode", "value must be one of"),
        ({"agents": {"nftables": {"masqueradeBits": 3}}}, "/agents/nftables", "masqueradeBits"),
        ({"agents": {"nftables": {"masqueradeBit": 40}}}, "/agents/nftables/masqueradeBit", "40"),
        ({"agents": {"ipvs": {"scheduler": "fastest"}}}, "/agents/ipvs/scheduler", "one of"),
        ({"agents": {"common": {"clusterCidrs": []}}}, "/agents/common", "'clusterCidrs'"),
        (
            {"agents": {"common": {"healthzBindAddress": "any"}}},
            "/common/healthzBindAddress",
            "any",
        ),
        (
            {"agents": {"common": {"tolerations": [{"operatr": "Exists"}]}}},
            "/tolerations/0",
            "operatr",
        ),
        ({"operator": {"ipvsPolicy": "maybe"}}, "/operator/ipvsPolicy", "'allow', 'warn', 'deny'"),
        ({"operator": {"replicaCount": 3}}, "/operator", UNKNOWN.format("replicaCount")),
        ({"operator": {"apiserverEndpoint": "2001:db8::1:6443"}}, "/apiserverEndpoint", "2001"),
        ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "/requests/cpu", "lots"),
        ({"proxyConfiguration": {"name": "Default"}}, "/proxyConfiguration/name", "Default"),
        ({"agent": {}}, "", UNKNOWN.format("agent")),
        ({"flowControl": {"enabled": True}}, "/flowControl", UNKNOWN.format("enabled")),
        ({"flowControl": {"matchingPrecedence": 0}}, "/flowControl/matchingPrecedence", "0"),
    ],
)
def test_schema_rejects(helm_env: dict[str, str], values: Obj, where: str, what: str) -> None:
    """helm fails before rendering anything, naming the value (a JSON pointer) and the problem."""
    out = template(helm_env, values)
    assert out.returncode != 0, f"accepted: {values}"
    assert "values don't meet the specifications of the schema" in out.stderr, out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("- at '")]
    pointer = line.removeprefix("- at '").partition("'")[0]
    assert pointer.endswith(where) if where else pointer == "", line
    assert what in line, line


def test_schema_error_message_for_a_bad_mode(helm_env: dict[str, str]) -> None:
    """What a user sees (pinned to helm's wording, so a helm upgrade shows a change here)."""
    out = template(helm_env, {"agents": {"mode": "userspace"}})
    assert "at '/agents/mode'" in out.stderr, out.stderr
    assert "value must be one of 'nftables', 'iptables', 'ipvs'" in out.stderr, out.stderr
