"""The Helm chart charts/kpx, rendered by the pinned helm (toolchain/build-helm.sh, `make setup`).

With default values the operator's objects are exactly operator/manifests (but the Namespace,
which belongs to the release, the labels Helm charts add, and what only the chart has: the
templated CRD, the operator's PodDisruptionBudget, the `helm test` hook); the
ProxyConfiguration is a valid spec for every mode and carries only the selected mode's block;
values.schema.json rejects what it should with a message naming the value; the chart's CRD
template and the CRD-derived part of its schema are what crds/ gives; every value is documented
in docs/helm.md. helm missing is a failure, never a skip.
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


#: The kind the templated CRD makes served: given to `helm template` as an installed cluster
#: (any upgrade) shows it, so the ProxyConfiguration renders as an ordinary object.
SERVED = ("--api-versions", "proxy.kpx.dev/v1alpha1/ProxyConfiguration")


def template(
    env: dict[str, str],
    values: Obj | None = None,
    *extra: str,
    namespace: str = NAMESPACE,
    served: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`helm template kpx charts/kpx` with these values (as a values file) and extra args;
    `served`: as on a cluster that serves ProxyConfigurations (the CRD is installed)."""
    args = ["template", "kpx", str(CHART), "--namespace", namespace, *(SERVED if served else ())]
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
    env: dict[str, str],
    values: Obj | None = None,
    *extra: str,
    namespace: str = NAMESPACE,
    served: bool = True,
    tests: bool = False,
) -> list[Obj]:
    """The rendered objects; without the `helm test` hook's unless `tests`."""
    flags = [*extra, *(() if tests else ("--skip-tests",))]
    out = template(env, values, *flags, namespace=namespace, served=served)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


#: What the chart renders with default values that operator/manifests has not.
CHART_ONLY = ("CustomResourceDefinition", "PodDisruptionBudget")


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
    for dist in ("api", "kube", "agents", "operator", "harness"):  # appVersion is kpx's version
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


def test_chart_crd_is_the_repos_crd(helm_env: dict[str, str]) -> None:
    """The chart's CRD is a template (templates/crds/, so that `helm upgrade` upgrades it; the
    chart has no crds/ directory, which Helm never upgrades): rendered, it is crds/'s CRD with
    the chart's labels and the keep policy."""
    assert not (CHART / "crds").exists()
    templates = sorted(p.name for p in sync_from_crds.CRD_TEMPLATES.iterdir())
    assert templates == sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    crds = [o for o in render(helm_env) if o["kind"] == "CustomResourceDefinition"]
    assert len(crds) == len(templates)
    for crd in crds:
        name = crd["metadata"]["name"]
        repo = yaml.safe_load((REPO / "crds" / f"{name}.yaml").read_text())
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        crd["metadata"] = {"name": name}
        assert crd == repo
    loose = render(helm_env, {"crds": {"install": True, "keep": False}})
    for crd in loose:
        if crd["kind"] == "CustomResourceDefinition":
            assert "annotations" not in crd["metadata"]
    none = render(helm_env, {"crds": {"install": False, "keep": True}})
    assert "CustomResourceDefinition" not in {o["kind"] for o in none}


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
        sync_from_crds.CRD_TEMPLATES / sync_from_crds.CRD_NAME,
        sync_from_crds.GITOPS / "crds" / sync_from_crds.CRD_NAME,
        sync_from_crds.SCHEMA,
    }


#: `agents` values that are not spec fields: the operator's flags for the agents, and the
#: agents' ServiceAccount.
AGENTS_CHART_ONLY = (
    "logLevel",
    "extraArgs",
    "metricsOnLoopback",
    "serviceAccount",
    "podAnnotations",
    "podLabels",
    "extraEnv",
)


def test_agents_values_cover_the_whole_spec() -> None:
    """Every spec field has its place in `agents` (mode, a mode's block, or common)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defs = schema["definitions"]
    agents = set(schema["properties"]["agents"]["properties"]) - {"common", *AGENTS_CHART_ONLY}
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
    rendered = {
        key(o): o
        for o in render(helm_env)
        if o["kind"] != "ProxyConfiguration" and o["kind"] not in CHART_ONLY
    }
    expected = {key(o): o for o in manifests() if o["kind"] != "Namespace"}
    assert sorted(rendered) == sorted(expected)
    for k, obj in rendered.items():
        assert without_helm_labels(obj) == expected[k], k


def test_no_namespace_object(helm_env: dict[str, str]) -> None:
    """The namespace is the release's (helm install -n), not an object of the chart."""
    assert all(o["kind"] != "Namespace" for o in render(helm_env))


CLUSTER_SCOPED = (
    "ClusterRole",
    "ClusterRoleBinding",
    "ProxyConfiguration",
    "FlowSchema",
    "PriorityLevelConfiguration",
    "CustomResourceDefinition",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def test_flow_control_can_be_left_out_or_tuned(helm_env: dict[str, str]) -> None:
    kinds = {o["kind"] for o in render(helm_env)}
    assert {"FlowSchema", "PriorityLevelConfiguration"} <= kinds
    tuned = {
        "flowControl": {"create": True, "nominalConcurrencyShares": 10, "matchingPrecedence": 700}
    }
    objs = render(helm_env, tuned)
    assert the(objs, "FlowSchema")["spec"]["matchingPrecedence"] == 700
    level = the(objs, "PriorityLevelConfiguration")["spec"]["limited"]
    assert level["nominalConcurrencyShares"] == 10
    off = render(
        helm_env,
        {
            "flowControl": {
                "create": False,
                "nominalConcurrencyShares": 40,
                "matchingPrecedence": 850,
            }
        },
    )
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
        "proxy-operator",
        "--namespace",
        NAMESPACE,
        *AGENT_IMAGE_FLAG,
        "--ipvs-policy",
        policy,
    ]


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
        (
            {"repository": "registry.example:5000/kpx/agent", "tag": "dev"},
            "registry.example:5000/kpx/agent:dev",
        ),
    ],
)
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
    assert pxc["spec"] == {
        "mode": "nftables",
        "clusterCIDRs": [],
        "tolerations": [{"operator": "Exists"}],
        "metricsBindAddress": "0.0.0.0:10249",
    }
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
    assert pxc["spec"] == {
        **spec,
        "tolerations": spec.get("tolerations", []),
        "metricsBindAddress": spec.get("metricsBindAddress", "0.0.0.0:10249"),
    }
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
        "metricsBindAddress": "0.0.0.0:10249",
        **common,
    }
    assert parse_spec(spec).max_unavailable == "10%"


def test_proxyconfiguration_can_be_left_out(helm_env: dict[str, str]) -> None:
    objs = render(helm_env, {"proxyConfiguration": {"create": False}})
    assert "ProxyConfiguration" not in {o["kind"] for o in objs}
    kinds = {o["kind"] for o in manifests()} - {"Namespace"}
    assert {o["kind"] for o in objs} == kinds | set(CHART_ONLY)


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
        ({"operator": {"logLevel": "trace"}}, "/operator/logLevel", "'info', 'debug'"),
        ({"agents": {"logLevel": 4}}, "/agents/logLevel", "string"),
        (
            {"operator": {"podDisruptionBudget": {"enabled": True, "minAvailable": 1}}},
            "/operator/podDisruptionBudget",
            UNKNOWN.format("minAvailable"),
        ),
        (
            {"operator": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "half"}}},
            "/podDisruptionBudget/maxUnavailable",
            "half",
        ),
        ({"operator": {"updateStrategy": {"type": "OnDelete"}}}, "/updateStrategy/type", "one of"),
        (
            {"operator": {"affinity": {"nodeAfinity": {}}}},
            "/operator/affinity",
            UNKNOWN.format("nodeAfinity"),
        ),
        (
            {"operator": {"topologySpreadConstraints": [{"maxSkew": 1}]}},
            "/topologySpreadConstraints/0",
            "missing properties",
        ),
        ({"operator": {"extraEnv": [{"value": "x"}]}}, "/operator/extraEnv/0", "name"),
        ({"operator": {"extraArgs": "-v"}}, "/operator/extraArgs", "array"),
        ({"operator": {"podLabels": {"team": 1}}}, "/operator/podLabels/team", "string"),
        ({"operator": {"podLabels": {"team": "a/b"}}}, "/operator/podLabels/team", "a/b"),
        (
            {"operator": {"podAnnotations": {"-x": "1"}}},
            "/operator/podAnnotations",
            UNKNOWN.format("-x"),
        ),
        (
            {"operator": {"serviceAccount": {"name": "Bad_Name"}}},
            "/serviceAccount/name",
            "Bad_Name",
        ),
        ({"agents": {"metricsOnLoopback": "yes"}}, "/agents/metricsOnLoopback", "boolean"),
        ({"agents": {"podLabels": {"team": 1}}}, "/agents/podLabels/team", "string"),
        ({"agents": {"podLabels": {"team": "a b"}}}, "/agents/podLabels/team", "a b"),
        (
            {"agents": {"podAnnotations": {"bad key": "x"}}},
            "/agents/podAnnotations",
            UNKNOWN.format("bad key"),
        ),
        ({"agents": {"extraEnv": [{"name": "TZ"}]}}, "/agents/extraEnv/0", "value"),
        (
            {"agents": {"extraEnv": [{"name": "TZ", "value": "UTC", "valueFrom": {}}]}},
            "/agents/extraEnv/0",
            UNKNOWN.format("valueFrom"),
        ),
        (
            {"agents": {"serviceAccount": {"name": "x"}}},
            "/agents/serviceAccount",
            UNKNOWN.format("name"),
        ),
        ({"rbac": {"enabled": True}}, "/rbac", UNKNOWN.format("enabled")),
        ({"crds": {"upgrade": True}}, "/crds", UNKNOWN.format("upgrade")),
        ({"fullnameOverride": "Kpx"}, "/fullnameOverride", "Kpx"),
        ({"monitoring": {"serviceMonitor": {}}}, "/monitoring", UNKNOWN.format("serviceMonitor")),
        (
            {"monitoring": {"podMonitor": {"enabled": True, "interval": "often"}}},
            "/podMonitor/interval",
            "often",
        ),
        ({"tests": {"timeoutSeconds": 0}}, "/tests/timeoutSeconds", "0"),
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


# ---- CRD upgrades: the ProxyConfiguration on a first install -------------------------------------


def test_first_install_creates_the_proxyconfiguration_after_its_crd(
    helm_env: dict[str, str],
) -> None:
    """Helm builds every object of a release before creating any: on a cluster that does not
    serve ProxyConfigurations yet, the ProxyConfiguration is a post-install hook (created after
    the CRD) carrying the release's ownership metadata, so the next upgrade adopts it."""
    pxc = the(render(helm_env, served=False), "ProxyConfiguration")
    assert pxc["metadata"]["annotations"] == {
        "helm.sh/resource-policy": "keep",
        "helm.sh/hook": "post-install",
        "helm.sh/hook-delete-policy": "hook-failed",
        "meta.helm.sh/release-name": "kpx",
        "meta.helm.sh/release-namespace": NAMESPACE,
    }
    served = the(render(helm_env), "ProxyConfiguration")
    assert served["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert served["spec"] == pxc["spec"]


# ---- names, ServiceAccounts, RBAC ----------------------------------------------------------------


def names(objs: list[Obj]) -> set[tuple[str, str]]:
    return {key(o) for o in objs}


@pytest.mark.parametrize(
    ("values", "prefix"),
    [
        ({"nameOverride": "proxy"}, "proxy"),
        ({"nameOverride": "x", "fullnameOverride": "edge"}, "edge"),
    ],
)
def test_name_overrides(helm_env: dict[str, str], values: Obj, prefix: str) -> None:
    objs = render(helm_env, values, tests=True)
    for obj in objs:
        if obj["kind"] not in ("ProxyConfiguration", "CustomResourceDefinition"):
            assert obj["metadata"]["name"].startswith(f"{prefix}-"), key(obj)
    deployment = the(objs, "Deployment")
    assert deployment["metadata"]["name"] == f"{prefix}-operator"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{prefix}-operator"
    command = pod["containers"][0]["command"]
    flag = command.index("--agent-service-account")
    assert command[flag + 1] == f"{prefix}-agent"
    for obj in objs:
        for subject in obj.get("subjects", []):
            if obj["kind"].endswith("Binding"):
                assert subject["name"] in (
                    f"{prefix}-operator",
                    f"{prefix}-agent",
                    f"{prefix}-test",
                )
    (flow,) = [o for o in objs if o["kind"] == "FlowSchema"]
    assert flow["spec"]["priorityLevelConfiguration"]["name"] == f"{prefix}-agent"
    sa = flow["spec"]["rules"][0]["subjects"][0]["serviceAccount"]
    assert sa == {"name": f"{prefix}-agent", "namespace": NAMESPACE}
    # The operator's default agent ServiceAccount needs no flag (operator/manifests has none).
    default = operator_container(render(helm_env))["command"]
    assert "--agent-service-account" not in default


def test_service_accounts_and_rbac_switches(helm_env: dict[str, str]) -> None:
    values = {
        "rbac": {"create": False},
        "operator": {"serviceAccount": {"create": False, "name": "existing"}},
        "agents": {"serviceAccount": {"create": False}},
    }
    objs = render(helm_env, values, tests=True)
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    # Only the test hook's own ServiceAccount is left.
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"] == ["kpx-test"]
    pod = the(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"
    annotated = render(
        helm_env,
        {
            "operator": {"serviceAccount": {"annotations": {"a": "1"}}},
            "agents": {"serviceAccount": {"annotations": {"b": "2"}}},
        },
    )
    sas = {o["metadata"]["name"]: o for o in annotated if o["kind"] == "ServiceAccount"}
    assert sas["kpx-operator"]["metadata"]["annotations"] == {"a": "1"}
    assert sas["kpx-agent"]["metadata"]["annotations"] == {"b": "2"}


# ---- the operator's pods -------------------------------------------------------------------------


def test_operator_pod_values(helm_env: dict[str, str]) -> None:
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "kpx-operator"}},
        }
    ]
    values = {
        "operator": {
            "logLevel": "debug",
            "extraArgs": ["--resync-interval", "30"],
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
            "podAnnotations": {"example.com/scrape": "true"},
            "podLabels": {"team": "net", "app.kubernetes.io/name": "ignored"},
            "affinity": {
                "podAntiAffinity": None,
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/os",
                                        "operator": "In",
                                        "values": ["linux"],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
            "topologySpreadConstraints": spread,
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
            },
        }
    }
    deployment = the(render(helm_env, values), "Deployment")
    template = deployment["spec"]["template"]
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert container["command"][-3:] == ["-v", "--resync-interval", "30"]
    assert container["env"][-1] == {"name": "TZ", "value": "UTC"}
    assert template["metadata"]["annotations"] == {"example.com/scrape": "true"}
    assert template["metadata"]["labels"] == {
        "team": "net",
        "app.kubernetes.io/name": "kpx-operator",
        "app.kubernetes.io/part-of": "kpx",
    }
    assert set(pod["affinity"]) == {"nodeAffinity"}  # null removes the default anti-affinity
    assert pod["topologySpreadConstraints"] == spread
    assert deployment["spec"]["strategy"] == values["operator"]["updateStrategy"]
    default = the(render(helm_env), "Deployment")
    assert "strategy" not in default["spec"]
    assert set(default["spec"]["template"]["spec"]["affinity"]) == {"podAntiAffinity"}


def test_operator_pod_disruption_budget(helm_env: dict[str, str]) -> None:
    pdb = the(render(helm_env), "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "kpx-operator"
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"app.kubernetes.io/name": "kpx-operator"}},
    }
    deployment = the(render(helm_env), "Deployment")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    half = render(
        helm_env, {"operator": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"}}}
    )
    assert the(half, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "50%"
    off = render(helm_env, {"operator": {"podDisruptionBudget": {"enabled": False}}})
    assert "PodDisruptionBudget" not in {o["kind"] for o in off}


# ---- the agents: through the operator's flags and the spec ---------------------------------------


def test_agents_log_level_and_args_go_through_the_operator(helm_env: dict[str, str]) -> None:
    values = {"agents": {"logLevel": "debug", "extraArgs": ["--foo", "a b"]}}
    command = operator_container(render(helm_env, values))["command"]
    assert command[-3:] == ["--agent-arg=-v", "--agent-arg=--foo", "--agent-arg=a b"]
    assert not [a for a in operator_container(render(helm_env))["command"] if "agent-arg" in a]


def test_agents_pod_metadata_and_env_go_through_the_operator(helm_env: dict[str, str]) -> None:
    """agents.podAnnotations, podLabels and extraEnv become the operator's flags, and the
    operator, started with the chart's command line, puts them on the agents' pods."""
    from kpx_operator.builders import Owner, agent_daemonset
    from kpx_operator.cli import build_options, parser

    values = {
        "agents": {
            "podAnnotations": {"prometheus.io/scrape": "true", "a": "x=y z"},
            "podLabels": {"team": "net"},
            "extraEnv": [{"name": "TZ", "value": "UTC"}, {"name": "HTTPS_PROXY", "value": ""}],
        }
    }
    objs = render(helm_env, values)
    command = operator_container(objs)["command"]
    assert command[-5:] == [
        "--agent-pod-annotation=a=x=y z",
        "--agent-pod-annotation=prometheus.io/scrape=true",
        "--agent-pod-label=team=net",
        "--agent-env=TZ=UTC",
        "--agent-env=HTTPS_PROXY=",
    ]
    assert command[0] == "proxy-operator"
    options = build_options(parser().parse_args(command[1:]))
    spec = parse_spec(the(objs, "ProxyConfiguration")["spec"])
    template = agent_daemonset(Owner("default", "uid"), spec, options)["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "net"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "kpx-agent"
    annotations = template["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["a"]) == ("true", "x=y z")
    env = template["spec"]["containers"][0]["env"]
    assert env[-2:] == [{"name": "TZ", "value": "UTC"}, {"name": "HTTPS_PROXY", "value": ""}]
    default = operator_container(render(helm_env))["command"]
    assert not [a for a in default if a.startswith(("--agent-pod", "--agent-env"))]


@pytest.mark.parametrize(
    ("agents", "address"),
    [
        ({}, "0.0.0.0:10249"),
        ({"metricsOnLoopback": True}, "127.0.0.1:10249"),
        (
            {"metricsOnLoopback": True, "common": {"metricsBindAddress": "0.0.0.0:9100"}},
            "0.0.0.0:9100",
        ),
        ({"common": {"metricsBindAddress": "[::1]:10249"}}, "[::1]:10249"),
    ],
)
def test_agents_metrics_address(helm_env: dict[str, str], agents: Obj, address: str) -> None:
    spec = the(render(helm_env, {"agents": agents}), "ProxyConfiguration")["spec"]
    assert spec["metricsBindAddress"] == address
    parse_spec(spec)


def test_pod_monitor(helm_env: dict[str, str]) -> None:
    assert "PodMonitor" not in {o["kind"] for o in render(helm_env)}
    values = {
        "monitoring": {
            "podMonitor": {
                "enabled": True,
                "labels": {"release": "prom"},
                "interval": "15s",
                "metricRelabelings": [{"action": "labeldrop", "regex": "pod"}],
            }
        }
    }
    monitors = {
        o["metadata"]["name"]: o for o in render(helm_env, values) if o["kind"] == "PodMonitor"
    }
    assert set(monitors) == {"kpx-agent", "kpx-operator"}
    operator = monitors["kpx-operator"]
    assert operator["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kpx-operator"}
    }
    (endpoint,) = operator["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert operator["metadata"]["labels"]["release"] == "prom"
    monitor = monitors["kpx-agent"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prom"
    # The operator's agent pods: their labels and their port `metrics` (builders._agent_ports).
    assert monitor["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "kpx-agent"}}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        "metrics",
        "/metrics",
        "15s",
    )
    assert {"action": "replace", "targetLabel": "job", "replacement": "kube-proxy"} in endpoint[
        "relabelings"
    ]
    assert endpoint["metricRelabelings"] == [{"action": "labeldrop", "regex": "pod"}]
    values["agents"] = {"metricsOnLoopback": True}
    out = template(helm_env, values)
    assert out.returncode != 0
    assert "monitoring.podMonitor.enabled" in out.stderr and "metricsOnLoopback" in out.stderr


def test_metrics_port_matches_the_pod_monitor() -> None:
    """The agents' DaemonSet the operator builds from the chart's default spec declares the
    port the PodMonitor names."""
    from kpx_operator.builders import BuildOptions, Owner, agent_daemonset

    spec = parse_spec({"mode": "nftables", "metricsBindAddress": "0.0.0.0:10249"})
    ds = agent_daemonset(Owner("default", "uid"), spec, BuildOptions())
    ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "metrics", "containerPort": 10249, "protocol": "TCP"} in ports


# ---- helm test -----------------------------------------------------------------------------------


def test_helm_test_hook(helm_env: dict[str, str]) -> None:
    objs = [
        o
        for o in render(helm_env, tests=True)
        if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    assert sorted(key(o) for o in objs) == sorted(
        (kind, "kpx-test")
        for kind in (
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
            "Pod",
        )
    )
    for obj in objs:  # a passed test leaves nothing (helm uninstall deletes no test hook)
        policy = obj["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        assert policy == "before-hook-creation,hook-succeeded"
    pod = the(objs, "Pod")
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "ghcr.io/kpx/kpx-operator:0.1.0"  # already on the nodes
    assert container["command"][:2] == ["python3", "-c"]
    assert container["command"][2] == (CHART / "files" / "helm-test.py").read_text()
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["NAMESPACE"], env["DEPLOYMENT"], env["PROXYCONFIGURATION"]) == (
        NAMESPACE,
        "kpx-operator",
        "default",
    )
    # Read-only access to exactly the two objects the test reads.
    assert the(objs, "Role")["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "resourceNames": ["kpx-operator"],
            "verbs": ["get"],
        }
    ]
    assert the(objs, "ClusterRole")["rules"] == [
        {
            "apiGroups": ["proxy.kpx.dev"],
            "resources": ["proxyconfigurations"],
            "resourceNames": ["default"],
            "verbs": ["get"],
        }
    ]
    own = render(
        helm_env,
        {
            "tests": {"image": {"repository": "registry.example/py", "tag": "3"}},
            "proxyConfiguration": {"create": False},
        },
        tests=True,
    )
    assert the(own, "Pod")["spec"]["containers"][0]["image"] == "registry.example/py:3"
    assert "ClusterRole" not in {o["kind"] for o in own if o["metadata"]["name"] == "kpx-test"}


def _helm_test_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("helm_test", CHART / "files" / "helm-test.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_helm_test_checks() -> None:
    """The test Pod's judgements (files/helm-test.py), on objects as the apiserver returns them."""
    m = _helm_test_module()
    deployment = {
        "metadata": {"generation": 2},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 2,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "updatedReplicas": 2,
        },
    }
    assert m.deployment_ready(deployment)[0]
    for field, value in (
        ("readyReplicas", 1),
        ("availableReplicas", 1),
        ("updatedReplicas", 1),
        ("observedGeneration", 1),
    ):
        stale = copy.deepcopy(deployment)
        stale["status"][field] = value
        assert not m.deployment_ready(stale)[0], field
    pxc = {
        "metadata": {"generation": 3},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "AllAgentsReady",
                    "message": "",
                    "observedGeneration": 3,
                }
            ]
        },
    }
    assert m.proxyconfiguration_ready(pxc)[0]
    old = copy.deepcopy(pxc)
    old["status"]["conditions"][0]["observedGeneration"] = 2
    assert not m.proxyconfiguration_ready(old)[0]
    not_ready = copy.deepcopy(pxc)
    not_ready["status"]["conditions"][0].update(status="False", reason="RollingOut")
    ok, said = m.proxyconfiguration_ready(not_ready)
    assert not ok and "RollingOut" in said
    assert m.proxyconfiguration_ready({"metadata": {}}) == (False, "no Ready condition yet")
    assert m.base_url("10.96.0.1", "443") == "https://10.96.0.1:443"
    assert m.base_url("fd00::1", "443") == "https://[fd00::1]:443"


# ---- the text users read -------------------------------------------------------------------------


STALE = ("no ipvs backend", "has an ipvs backend", "ModeNotImplemented")


def test_no_stale_text_about_ipvs() -> None:
    """kubectl explain (the CRD's descriptions), values.yaml, the schema and the operator's
    --help say what is: the agent has an ipvs backend."""
    from kpx_operator.cli import parser

    texts = {
        "crds/": (REPO / "crds" / sync_from_crds.CRD_NAME).read_text(),
        "values.yaml": (CHART / "values.yaml").read_text(),
        "values.schema.json": (CHART / "values.schema.json").read_text(),
        "proxy-operator --help": parser().format_help(),
        "docs/helm.md": (REPO / "docs" / "helm.md").read_text(),
    }
    for where, text in texts.items():
        flat = " ".join(text.split())
        for phrase in STALE:
            assert phrase not in flat, f"{where} says {phrase!r}"


# ---- docs/helm.md --------------------------------------------------------------------------------


#: Values whose content is a Kubernetes (or CRD) object, documented as a whole: the keys of
#: their defaults (e.g. operator.resources.requests.cpu) are that object's fields.
OBJECT_VALUES = (
    "operator.resources",
    "operator.tolerations",
    "operator.affinity",
    "agents.common.tolerations",
)


def value_keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Every value of values.yaml as a dotted path: the leaves (a scalar, a list, an empty map)
    and OBJECT_VALUES, not the maps that only group them."""
    if isinstance(node, dict) and node and prefix not in OBJECT_VALUES:
        for name, child in node.items():
            yield from value_keys(child, f"{prefix}.{name}" if prefix else name)
    else:
        yield prefix


def test_docs_document_every_value() -> None:
    """Every value of values.yaml has a row of its own in docs/helm.md's tables, starting with
    its full dotted path in backquotes (| `operator.podDisruptionBudget.maxUnavailable` |)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    docs = (REPO / "docs" / "helm.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)`", docs, re.M)}
    keys = list(value_keys(values))
    assert [path for path in keys if path not in rows] == []
    # Not vacuous: the walk reaches nested values and stops at whole objects.
    assert {
        "operator.podDisruptionBudget.maxUnavailable",
        "monitoring.podMonitor.jobName",
        "agents.common.clusterCIDRs",
        "operator.resources",
        "agents.nftables",
        "operator.podAnnotations",
        "nameOverride",
    } <= set(keys)
    assert not [k for k in keys if k.startswith("operator.resources.")]


# ---- make chart ----------------------------------------------------------------------------------


def test_make_chart_is_a_loadable_chart_repository(
    helm_env: dict[str, str], tmp_path: Path
) -> None:
    """charts/package.py (`make chart`) writes the package and an index; served over HTTP on
    loopback, it is a chart repository helm adds, pulls from and renders, as the chart itself."""
    import functools
    import hashlib
    import http.server
    import threading

    sys.path.insert(0, str(REPO / "charts"))
    import package as chart_package

    out = tmp_path / "repo"
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=out)
    )
    url = f"http://127.0.0.1:{server.server_address[1]}"
    tgz = chart_package.package(out, url=url, helm=helm_binary())
    assert tgz == out / "kpx-0.1.0.tgz"
    index = yaml.safe_load((out / "index.yaml").read_text())
    (entry,) = index["entries"]["kpx"]
    assert (entry["version"], entry["appVersion"]) == ("0.1.0", "0.1.0")
    assert entry["urls"] == [f"{url}/kpx-0.1.0.tgz"]
    assert entry["digest"] == hashlib.sha256(tgz.read_bytes()).hexdigest()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert helm(helm_env, "repo", "add", "kpx-test", url).returncode == 0
        pulled = tmp_path / "pulled"
        pulled.mkdir()
        out_pull = helm(helm_env, "pull", "kpx-test/kpx", "--version", "0.1.0", "-d", str(pulled))
        assert out_pull.returncode == 0, out_pull.stderr
    finally:
        server.shutdown()
        helm(helm_env, "repo", "remove", "kpx-test")
    packaged = helm(
        helm_env,
        "template",
        "kpx",
        str(pulled / "kpx-0.1.0.tgz"),
        "--namespace",
        NAMESPACE,
        *SERVED,
    )
    assert packaged.returncode == 0, packaged.stderr
    assert packaged.stdout == template(helm_env).stdout
    # The package holds the test hook's script and no chart crds/ directory.
    listing = subprocess.run(["tar", "-tzf", str(tgz)], capture_output=True, text=True).stdout
    assert "kpx/files/helm-test.py" in listing.split()
    assert not [p for p in listing.split() if p.startswith("kpx/crds/")]
