"""The operator's pure builders: golden output per mode, live changes vs rollouts, least
privilege (the agents' ClusterRole installed with the operator, and the operator's own RBAC,
which holds no permission on roles or bindings)."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import ProxyConfigurationSpec, agent_config_from_spec, parse_agent_config, parse_spec
from kpx_operator import __version__, builders
from kpx_operator.builders import BuildOptions, Owner
from kpx_operator.names import (
    AGENT_CLUSTER_ROLE,
    AGENT_SERVICE_ACCOUNT,
    MAX_NAME,
    RESTART_HASH_ANNOTATION,
    bounded,
    child_names,
    instance,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "operator"
MANIFESTS = REPO / "operator" / "manifests"
EXAMPLES = {
    "nftables": REPO / "examples" / "proxyconfig.yaml",
    "iptables": REPO / "examples" / "proxyconfig-iptables.yaml",
    "ipvs": REPO / "examples" / "proxyconfig-ipvs.yaml",
    "external": REPO / "examples" / "proxyconfig-external.yaml",
}
UID = "00000000-0000-4000-8000-000000000001"
OPTS = BuildOptions()

Obj = dict[str, Any]


def example(mode: str) -> tuple[Owner, ProxyConfigurationSpec]:
    doc = yaml.safe_load(EXAMPLES[mode].read_text())
    return Owner(doc["metadata"]["name"], UID), parse_spec(doc["spec"])


def spec_with(spec: ProxyConfigurationSpec, **changes: Any) -> ProxyConfigurationSpec:
    return parse_spec({**spec.to_dict(), **changes})


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's file) as literal blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def all_children(
    owner: Owner, spec: ProxyConfigurationSpec, opts: BuildOptions = OPTS
) -> list[Obj]:
    return [
        *builders.agent_children(owner, spec, opts),
        builders.cleanup_daemonset(owner, spec, opts),
    ]


def render(owner: Owner, spec: ProxyConfigurationSpec) -> str:
    return yaml.dump_all(all_children(owner, spec), Dumper=_Dumper, sort_keys=False, width=100)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KPX_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with KPX_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{name} changed; review and set KPX_UPDATE_GOLDEN=1"


def by_kind(objs: Iterable[Obj]) -> dict[str, Obj]:
    return {o["kind"]: o for o in objs}


def pod_spec(ds: Obj) -> Obj:
    return ds["spec"]["template"]["spec"]


# -- golden files -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_children_match_golden_file(mode: str) -> None:
    owner, spec = example(mode)
    assert str(spec.mode) == mode
    check_golden(f"{mode}.yaml", render(owner, spec))


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_configmap_holds_the_agent_config_the_agent_validates(mode: str) -> None:
    owner, spec = example(mode)
    cm = builders.config_map(owner, spec, OPTS)
    parsed = parse_agent_config(yaml.safe_load(cm["data"]["config.yaml"]))
    assert parsed == agent_config_from_spec(spec)


# -- the DaemonSets ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_agent_daemonset_runs_the_agent_with_least_privilege(mode: str) -> None:
    owner, spec = example(mode)
    ds = builders.agent_daemonset(owner, spec, OPTS)
    pod = pod_spec(ds)
    # Mode external adds the user's backend (test_external_backend_is_a_sidecar...).
    container, *sidecars = pod["containers"]
    assert [c["name"] for c in sidecars] == (["backend"] if mode == "external" else [])
    assert container["command"][:5] == [
        "proxy-agent",
        "--mode",
        mode,
        "--config",
        "/etc/kpx/config.yaml",
    ]
    # The examples keep the conntrack defaults (a table size): the agent is told where the
    # node's values are mounted (test_conntrack_access_only_when_settings_change_the_node).
    flags = ["--conntrack-sysctl-dir", "--conntrack-hashsize-file"]
    if mode == "ipvs":  # the node's net.ipv4 sysctls (vs.conntrack: masquerade)
        flags.append("--ipv4-sysctl-dir")
    if mode == "external":  # the state socket, in the directory shared with the backend
        flags.append("--state-socket")
    assert container["command"][5::2] == flags
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["priorityClassName"] == spec.priority_class_name
    assert pod["serviceAccountName"] == AGENT_SERVICE_ACCOUNT == "kpx-agent"
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    expected_caps = ["NET_ADMIN"] if mode == "nftables" else ["NET_ADMIN", "NET_RAW"]
    assert sc["capabilities"]["add"] == expected_caps
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 10256}
    assert container["livenessProbe"]["httpGet"] == {"path": "/alivez", "port": 10256}
    # liveness waits for the agent's first answer (a slow start is not a dead agent): the
    # startup probe gives it 5 min, the liveness probe has no fixed delay of its own
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/alivez", "port": 10256}
    assert startup["periodSeconds"] * startup["failureThreshold"] == 300
    assert "initialDelaySeconds" not in container["livenessProbe"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == spec.max_unavailable
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    assert pod.get("nodeSelector", {}) == spec.node_selector
    assert pod.get("tolerations", []) == [t.to_dict() for t in spec.tolerations]
    assert spec.image is None  # the examples leave the image to the operator
    assert container["image"] == OPTS.agent_image == f"ghcr.io/kpx/kpx-agent:{__version__}"
    # The pods carry the selector's labels.
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_agent_image_is_the_operators_unless_the_spec_overrides_it() -> None:
    """Upgrading the operator (a new --agent-image) moves agents whose spec sets no image; a
    spec.image pins them. Both DaemonSets (agents and cleanup) use the same image."""
    owner, spec = example("nftables")
    opts = BuildOptions(agent_image="registry.example/kpx-agent@sha256:" + "a" * 64)

    def images(spec: ProxyConfigurationSpec, opts: BuildOptions) -> set[str]:
        return {
            c["image"]
            for ds in (
                builders.agent_daemonset(owner, spec, opts),
                builders.cleanup_daemonset(owner, spec, opts),
            )
            for c in pod_spec(ds)["containers"]
        }

    assert images(spec, opts) == {opts.agent_image}
    assert images(spec, OPTS) == {OPTS.agent_image}
    pinned = spec_with(spec, image="registry.example/kpx-agent:pinned")
    assert images(pinned, opts) == {"registry.example/kpx-agent:pinned"}


def test_image_pull_secrets_reach_agent_and_cleanup_pods() -> None:
    owner, spec = example("iptables")
    for ds in (
        builders.agent_daemonset(owner, spec, OPTS),
        builders.cleanup_daemonset(owner, spec, OPTS),
    ):
        assert "imagePullSecrets" not in pod_spec(ds)
    opts = BuildOptions(image_pull_secrets=("regcred", "mirror"))
    for ds in (
        builders.agent_daemonset(owner, spec, opts),
        builders.cleanup_daemonset(owner, spec, opts),
    ):
        assert pod_spec(ds)["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_agent_args_and_service_account_from_the_operator() -> None:
    """--agent-arg (the chart's agents.logLevel and agents.extraArgs) ends every agent's command
    line; --agent-service-account (the chart's fullname) names the agents' ServiceAccount."""
    owner, spec = example("nftables")
    opts = BuildOptions(agent_args=("-v", "--foo=bar"), agent_service_account="mine-agent")
    pod = pod_spec(builders.agent_daemonset(owner, spec, opts))
    assert pod["containers"][0]["command"][-2:] == ["-v", "--foo=bar"]
    assert pod["serviceAccountName"] == "mine-agent"
    default = pod_spec(builders.agent_daemonset(owner, spec, OPTS))
    assert default["containers"][0]["command"][-1] != "-v"


def test_agent_pod_metadata_and_env_from_the_operator() -> None:
    """--agent-pod-annotation, --agent-pod-label and --agent-env (the chart's agents.podAnnotations,
    podLabels and extraEnv) reach the agents' pods beside the operator's own, which they cannot
    replace; the cleanup pods take none of them."""
    owner, spec = example("nftables")
    opts = BuildOptions(
        agent_pod_annotations=(("prometheus.io/scrape", "true"),),
        agent_pod_labels=(("team", "net"),),
        agent_env=(("TZ", "UTC"),),
    )
    ds = builders.agent_daemonset(owner, spec, opts)
    meta = ds["spec"]["template"]["metadata"]
    default = builders.agent_daemonset(owner, spec, OPTS)["spec"]["template"]
    assert meta["labels"] == {**default["metadata"]["labels"], "team": "net"}
    assert meta["annotations"] == {
        **default["metadata"]["annotations"],
        "prometheus.io/scrape": "true",
    }
    assert ds["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    env = pod_spec(ds)["containers"][0]["env"]
    assert env == [*default["spec"]["containers"][0]["env"], {"name": "TZ", "value": "UTC"}]
    assert not [
        e for e in default["spec"]["containers"][0]["env"] if not builders.operator_env(e["name"])
    ]
    cleanup = builders.cleanup_daemonset(owner, spec, opts)["spec"]["template"]["metadata"]
    assert "team" not in cleanup["labels"]


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        (
            "--agent-pod-label=app.kubernetes.io/name=x",
            "label app.kubernetes.io/name is the operator's own",
        ),
        ("--agent-pod-label=app.kubernetes.io/instance=x", "is the operator's own"),
        ("--agent-pod-label=team=a b", "label team: value 'a b' must be a label value"),
        ("--agent-pod-label=team", "expected KEY=VALUE, got 'team'"),
        ("--agent-pod-annotation=bad key=x", "annotation key 'bad key' must be a label key"),
        (f"--agent-pod-annotation={RESTART_HASH_ANNOTATION}=x", "is the operator's own"),
        ("--agent-env=NODE_NAME=x", "environment variable NODE_NAME is the operator's own"),
        ("--agent-env=KUBERNETES_SERVICE_HOST=1.2.3.4", "is the operator's own"),
        ("--agent-env=POD_UID=x", "is the operator's own"),
        ("--agent-env=KPX_STATE_API=x", "is the operator's own"),
        ("--agent-env=1X=y", "environment variable name '1X'"),
    ],
)
def test_operator_refuses_agent_pod_flags_naming_the_flag_and_reason(
    flag: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kpx_operator.cli import parser

    with pytest.raises(SystemExit) as exc:
        parser().parse_args([flag])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag.split('=')[0]}:" in err and why in err, err


@pytest.mark.parametrize(
    ("metrics", "ports"),
    [
        ("127.0.0.1:10249", {"healthz": 10256}),  # loopback: no port for Prometheus to name
        ("[::1]:10249", {"healthz": 10256}),
        ("0.0.0.0:10249", {"healthz": 10256, "metrics": 10249}),
        ("[::]:9100", {"healthz": 10256, "metrics": 9100}),
        ("10.0.0.1:10249", {"healthz": 10256, "metrics": 10249}),
    ],
)
def test_metrics_port_is_declared_unless_on_loopback(metrics: str, ports: dict[str, int]) -> None:
    owner, spec = example("nftables")
    spec = spec_with(spec, metricsBindAddress=metrics)
    container = pod_spec(builders.agent_daemonset(owner, spec, OPTS))["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == ports
    assert {p["protocol"] for p in container["ports"]} == {"TCP"}


def test_every_child_is_labelled_and_owned_by_no_one() -> None:
    """No ownerReference (issue #22): a garbage collector cascade, such as the foreground
    deletion Argo CD prunes with, would delete the agents before the operator applies
    spec.deletionPolicy (Orphan keeps them, Cleanup goes node by node). So no
    app.kubernetes.io/instance either: an Argo CD Application that tracks by that label and
    shares its value would take them for its own (top-level, no owner) and prune them."""
    owner, spec = example("nftables")
    for obj in all_children(owner, spec):
        meta = obj["metadata"]
        assert "ownerReferences" not in meta
        assert "app.kubernetes.io/instance" not in meta["labels"]
        assert not (meta.get("annotations") or {}).keys() & {"argocd.argoproj.io/tracking-id"}
        assert meta["labels"]["proxy.kpx.dev/configuration"] == "default"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kpx-operator"
        assert meta["labels"]["app.kubernetes.io/name"] in ("kpx-agent", "kpx-cleanup")
        assert meta["namespace"] == "kpx-system"
    # Nothing cluster-scoped, and no identity or permission: those are installed with it.
    assert {o["kind"] for o in all_children(owner, spec)} == {"ConfigMap", "DaemonSet"}


def test_cleanup_daemonset_cleans_the_same_nodes_and_reports_readiness() -> None:
    owner, spec = example("ipvs")
    agents = pod_spec(builders.agent_daemonset(owner, spec, OPTS))
    cleanup_ds = builders.cleanup_daemonset(owner, spec, OPTS)
    cleanup = pod_spec(cleanup_ds)
    (container,) = cleanup["containers"]
    assert container["command"] == [
        "proxy-agent",
        "cleanup",
        "--mode",
        "ipvs",
        "--then-serve-healthz",
        "0.0.0.0:10256",
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 10256}
    for key in ("tolerations", "hostNetwork", "priorityClassName"):
        assert cleanup[key] == agents[key]
    # The agents' nodes, and of those only the ones the operator labelled, one by one.
    assert cleanup["nodeSelector"] == {
        **agents["nodeSelector"],
        "proxy.kpx.dev/cleanup": "ipvs-pool",
    }
    assert cleanup["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in cleanup
    # Its pods never match the agents' selector (two DaemonSets must not share pods).
    agent_sel = builders.agent_daemonset(owner, spec, OPTS)["spec"]["selector"]["matchLabels"]
    cleanup_labels = cleanup_ds["spec"]["template"]["metadata"]["labels"]
    assert not agent_sel.items() <= cleanup_labels.items()


def test_probes_call_a_specific_healthz_address() -> None:
    owner, spec = example("nftables")
    spec = spec_with(spec, healthzBindAddress="127.0.0.1:10300")
    (container,) = pod_spec(builders.agent_daemonset(owner, spec, OPTS))["containers"]
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": 10300,
        "host": "127.0.0.1",
    }
    assert container["ports"] == [{"name": "healthz", "containerPort": 10300, "protocol": "TCP"}]


def test_apiserver_endpoint_reaches_the_agents() -> None:
    owner, spec = example("nftables")
    opts = BuildOptions(apiserver_endpoint="[2001:db8::1]:6443")
    (container,) = pod_spec(builders.agent_daemonset(owner, spec, opts))["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "2001:db8::1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"


def test_xtables_lock_only_for_modes_running_iptables() -> None:
    for mode in EXAMPLES:
        owner, spec = example(mode)
        pod = pod_spec(builders.agent_daemonset(owner, spec, OPTS))
        volumes = {v["name"] for v in pod["volumes"]}
        assert ("xtables-lock" in volumes) is (mode != "nftables")


# -- live changes vs rollouts -----------------------------------------------------------------


def _children(spec: ProxyConfigurationSpec) -> dict[str, Obj]:
    return by_kind(builders.agent_children(Owner("default", UID), spec, OPTS))


LIVE_CHANGES: dict[str, Obj] = {
    "namespace opt-out": {"namespaceOptOut": {"namespaces": ["legacy-proxy", "other"]}},
    "mode tuning": {"nftables": {"syncPeriod": "1m", "minSyncPeriod": "2s", "masqueradeAll": True}},
    "cluster CIDRs": {"clusterCIDRs": ["10.32.0.0/12"]},
}
ROLLOUT_CHANGES: dict[str, Obj] = {
    "mode": {"mode": "iptables", "nftables": None},
    "image": {"image": "ghcr.io/kpx/kpx-agent:0.2.0"},
    "resources": {"resources": {"requests": {"cpu": "100m"}}},
    "node selector": {"nodeSelector": {"kpx.dev/pool": "a"}},
    "tolerations": {"tolerations": []},
    "priority class": {"priorityClassName": "system-cluster-critical"},
    "healthz address": {"healthzBindAddress": "0.0.0.0:10300"},
    "metrics address": {"metricsBindAddress": "127.0.0.1:10300"},
    "conntrack": {"conntrack": {"maxPerCore": 0}},
}


@pytest.mark.parametrize("change", sorted(LIVE_CHANGES))
def test_live_change_updates_only_the_configmap(change: str) -> None:
    _, spec = example("nftables")
    before, after = _children(spec), _children(spec_with(spec, **LIVE_CHANGES[change]))
    assert before["ConfigMap"] != after["ConfigMap"]
    assert set(before) == {"ConfigMap", "DaemonSet"}
    assert before["DaemonSet"] == after["DaemonSet"]


@pytest.mark.parametrize("change", sorted(ROLLOUT_CHANGES))
def test_change_needing_new_pods_changes_the_pod_template(change: str) -> None:
    _, spec = example("nftables")
    changes = {k: v for k, v in ROLLOUT_CHANGES[change].items()}
    data = {k: v for k, v in {**spec.to_dict(), **changes}.items() if v is not None}
    before, after = _children(spec), _children(parse_spec(data))
    template = before["DaemonSet"]["spec"]["template"]
    assert template != after["DaemonSet"]["spec"]["template"]


@pytest.mark.parametrize("change", ["mode", "metrics address", "conntrack"])
def test_start_only_config_changes_the_template_hash(change: str) -> None:
    _, spec = example("nftables")
    data = {k: v for k, v in {**spec.to_dict(), **ROLLOUT_CHANGES[change]}.items() if v is not None}

    def annotation(s: ProxyConfigurationSpec) -> str:
        meta = _children(s)["DaemonSet"]["spec"]["template"]["metadata"]
        return str(meta["annotations"][RESTART_HASH_ANNOTATION])

    assert annotation(spec) != annotation(parse_spec(data))


# -- least privilege --------------------------------------------------------------------------


def _rules(objs: Iterable[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objs:
        for rule in obj.get("rules") or []:
            yield obj, rule


def _manifests() -> list[Obj]:
    return [
        d
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") != "Kustomization"
    ]


def _installed(kind: str, name: str) -> Obj:
    (obj,) = [o for o in _manifests() if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return obj


def test_agent_role_is_exactly_what_the_agent_reads() -> None:
    role = _installed("ClusterRole", AGENT_CLUSTER_ROLE)
    assert role["rules"] == list(builders.AGENT_RULES)
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (
            ("", "services"),
            ("", "namespaces"),
            ("", "nodes"),
            ("discovery.k8s.io", "endpointslices"),
        )
        for verb in ("get", "list", "watch")
    } | {("", "events", "create")} | {  # Warning Events on Services it leaves out
        # Its own node's ProxyNodeState (the admission policy keeps it to its own node).
        ("proxy.kpx.dev", "proxynodestates", "create"),
        ("proxy.kpx.dev", "proxynodestates", "get"),
        ("proxy.kpx.dev", "proxynodestates/status", "get"),
        ("proxy.kpx.dev", "proxynodestates/status", "patch"),
    }
    for _, rule in _rules([role]):
        assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "patch"}
        assert "create" not in rule["verbs"] or rule["resources"] in (
            ["events"],
            ["proxynodestates"],
        )
        assert "patch" not in rule["verbs"] or rule["resources"] == ["proxynodestates/status"]
        assert "secrets" not in rule["resources"]
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


def test_agents_run_as_the_installed_service_account_bound_to_the_agent_role() -> None:
    owner, spec = example("nftables")
    binding = _installed("ClusterRoleBinding", AGENT_CLUSTER_ROLE)
    sa = _installed("ServiceAccount", AGENT_SERVICE_ACCOUNT)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "kpx-agent",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kpx-agent", "namespace": "kpx-system"}
    ]
    assert sa["metadata"]["namespace"] == OPTS.namespace
    ds = builders.agent_daemonset(owner, spec, OPTS)
    assert pod_spec(ds)["serviceAccountName"] == sa["metadata"]["name"]


def test_operator_manifests_grant_no_wildcard_and_no_secrets() -> None:
    for obj, rule in _rules(_manifests()):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], obj["kind"]
        assert "secrets" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        if rule["apiGroups"] == [""] and {"services", "namespaces"} & set(rule["resources"]):
            assert set(rule["verbs"]) <= {"get", "list", "watch"}
        if rule["apiGroups"] == [""] and "nodes" in rule["resources"]:
            # patch: the label of spec.takeover.moveKubeProxyOff; never create or delete.
            assert set(rule["verbs"]) <= {"get", "list", "watch", "patch"}


def test_operator_may_touch_only_kube_proxys_daemonset_in_kube_system() -> None:
    """spec.takeover.moveKubeProxyOff: get and patch kube-system/kube-proxy, and list Pods
    (a Cleanup deletion waits for kube-proxy's Pod to be Ready on a node), nothing else."""
    in_kube_system = [
        (o, r) for o, r in _operator_rules() if o["metadata"].get("namespace") == "kube-system"
    ]
    assert [r for _, r in in_kube_system] == [
        {
            "apiGroups": ["apps"],
            "resources": ["daemonsets"],
            "resourceNames": ["kube-proxy"],
            "verbs": ["get", "patch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]


def test_operator_may_read_only_the_kubernetes_endpointslice_in_default() -> None:
    """The apiserver's addresses for the agents: get default/kubernetes, nothing else there."""
    in_default = [
        (o, r) for o, r in _operator_rules() if o["metadata"].get("namespace") == "default"
    ]
    assert [r for _, r in in_default] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "resourceNames": ["kubernetes"],
            "verbs": ["get"],
        }
    ]


def _grants(rules: Iterable[Obj]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        if not rule.get("resourceNames")
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _operator_rules() -> list[tuple[Obj, Obj]]:
    """The rules bound to the operator's ServiceAccount (its ClusterRole and Role)."""
    bound = {
        (o["roleRef"]["kind"], o["roleRef"]["name"])
        for o in _manifests()
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and {"kind": "ServiceAccount", "name": "kpx-operator", "namespace": "kpx-system"}
        in o["subjects"]
    }
    assert bound == {
        ("ClusterRole", "kpx-operator"),
        ("Role", "kpx-operator"),
        ("Role", "kpx-operator-takeover"),
        ("Role", "kpx-operator-apiserver"),
    }
    return [(o, r) for o, r in _rules(_manifests()) if (o["kind"], o["metadata"]["name"]) in bound]


def test_operator_holds_no_permission_on_roles_bindings_or_identities() -> None:
    """A compromised operator can neither rewrite nor delete any role or binding, nor grant
    anything: the agents' RBAC is installed with it, and it holds no RBAC rule at all."""
    for obj, rule in _operator_rules():
        assert "rbac.authorization.k8s.io" not in rule["apiGroups"], obj["kind"]
        assert not {"serviceaccounts", "serviceaccounts/token"} & set(rule["resources"])
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_operator_may_write_exactly_what_it_applies() -> None:
    owner, spec = example("nftables")
    objs = all_children(owner, spec)
    rules = _operator_rules()
    cluster = _grants(r for o, r in rules if o["kind"] == "ClusterRole")
    ns = _grants(r for o, r in rules if o["kind"] == "Role")
    plural = {"ConfigMap": "configmaps", "DaemonSet": "daemonsets"}
    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        held = ns if "namespace" in obj["metadata"] else cluster
        for verb in ("get", "create", "patch", "delete"):
            assert (group, plural[obj["kind"]], verb) in held, (obj["kind"], verb)


def test_operator_deployment_runs_two_replicas_of_proxy_operator() -> None:
    (deployment,) = [o for o in _manifests() if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The agents of the same release: one version in the operator and its agent image.
    assert container["command"] == [
        "proxy-operator",
        "--namespace",
        "kpx-system",
        "--agent-image",
        builders.DEFAULT_AGENT_IMAGE,
    ]
    assert container["image"] == f"ghcr.io/kpx/kpx-operator:{__version__}"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "kpx-operator"


# -- names ------------------------------------------------------------------------------------


def test_long_names_stay_within_63_characters_and_distinct() -> None:
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    for name in (a, b):
        names = child_names(name)
        assert len(names.agent) <= MAX_NAME and len(names.cleanup) <= MAX_NAME
        assert len(instance(name)) <= MAX_NAME
    assert child_names(a).agent != child_names(b).agent
    assert bounded("kpx-agent-", "default") == "kpx-agent-default"
    # Cut right after a dot: the dot goes, the name still ends with a letter or digit.
    cut_at_a_dot = bounded("kpx-agent-", "a" * 43 + "." + "b" * 30)
    assert re.fullmatch(r"kpx-agent-a{43}-[0-9a-f]{8}", cut_at_a_dot)


def test_builders_do_not_share_state_between_calls() -> None:
    owner, spec = example("nftables")
    first = builders.agent_daemonset(owner, spec, OPTS)
    pod_spec(first)["containers"][0]["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    first["metadata"]["labels"]["x"] = "y"
    assert builders.agent_daemonset(owner, spec, OPTS) != first
    assert copy.deepcopy(builders.AGENT_RULES) == builders.AGENT_RULES


# -- spec.conntrack: access to the node's values only when it changes them ---------------------

LEAVE_ALONE = {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"}


def _agent_pod(conntrack: Obj) -> Obj:
    owner, spec = example("nftables")
    return pod_spec(builders.agent_daemonset(owner, spec_with(spec, conntrack=conntrack), OPTS))


def _host_paths(pod: Obj) -> dict[str, str]:
    """hostPath -> where the agent container sees it."""
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    return {v["hostPath"]["path"]: mounts[v["name"]] for v in pod["volumes"] if "hostPath" in v}


@pytest.mark.parametrize(
    ("conntrack", "paths", "flags"),
    [
        # Every setting left alone: no access to the node's /proc/sys or /sys at all.
        (LEAVE_ALONE, {}, []),
        # Timeouts only: the netfilter sysctls, not the module parameters.
        (
            {**LEAVE_ALONE, "udpTimeout": "30s"},
            {"/proc/sys/net/netfilter": "/host/proc/sys/net/netfilter"},
            ["--conntrack-sysctl-dir", "/host/proc/sys/net/netfilter"],
        ),
        (
            {**LEAVE_ALONE, "tcpBeLiberal": True},
            {"/proc/sys/net/netfilter": "/host/proc/sys/net/netfilter"},
            ["--conntrack-sysctl-dir", "/host/proc/sys/net/netfilter"],
        ),
        # The table size (the defaults): the hashsize parameter too.
        (
            {},
            {
                "/proc/sys/net/netfilter": "/host/proc/sys/net/netfilter",
                "/sys/module/nf_conntrack/parameters": "/host/sys/module/nf_conntrack/parameters",
            },
            [
                "--conntrack-sysctl-dir",
                "/host/proc/sys/net/netfilter",
                "--conntrack-hashsize-file",
                "/host/sys/module/nf_conntrack/parameters/hashsize",
            ],
        ),
    ],
)
def test_conntrack_access_only_when_settings_change_the_node(
    conntrack: Obj, paths: dict[str, str], flags: list[str]
) -> None:
    pod = _agent_pod(conntrack)
    (container,) = pod["containers"]
    assert _host_paths(pod) == paths
    assert container["command"][5:] == flags
    for volume in pod["volumes"]:
        if "hostPath" in volume and volume["hostPath"]["path"] != "/run/xtables.lock":
            assert volume["hostPath"]["type"] == "Directory"  # never created by the kubelet
    # Never more than the mounts: the same unprivileged container either way.
    assert (
        container["securityContext"] == _agent_pod(LEAVE_ALONE)["containers"][0]["securityContext"]
    )
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}


def test_agents_know_their_pod() -> None:
    (container,) = _agent_pod({})["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {
        "NODE_NAME": "spec.nodeName",
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_UID": "metadata.uid",
    }


# -- route_localnet: the one file localhost NodePorts need, only where they are in effect ------

ROUTE_LOCALNET_NODE = "/proc/sys/net/ipv4/conf/all/route_localnet"
ROUTE_LOCALNET_POD = "/host/proc/sys/net/ipv4/conf/all/route_localnet"


@pytest.mark.parametrize(
    ("mode", "changes", "mounted"),
    [
        ("iptables", {"iptables": {"localhostNodePorts": True}}, True),
        ("iptables", {"iptables": {}}, True),  # the default is true, as upstream
        ("iptables", {"iptables": {"localhostNodePorts": False}}, False),
        # NodePorts on the primary IPs or other networks only: nothing on 127.0.0.1.
        ("iptables", {"iptables": {}, "nodePortAddresses": ["primary"]}, False),
        ("iptables", {"iptables": {}, "nodePortAddresses": ["10.0.0.0/8"]}, False),
        ("iptables", {"iptables": {}, "nodePortAddresses": ["127.0.0.0/8"]}, True),
        ("nftables", {}, False),  # off by default in nftables mode (upstream has none)
        ("nftables", {"nftables": {"localhostNodePorts": False}}, False),
        # kpx's opt-in, where nodePortAddresses allows 127.0.0.1 (the example has primary).
        ("nftables", {"nftables": {"localhostNodePorts": True}, "nodePortAddresses": []}, True),
        ("nftables", {"nftables": {"localhostNodePorts": True}}, False),
    ],
)
def test_route_localnet_is_mounted_only_where_localhost_node_ports_work(
    mode: str, changes: Obj, mounted: bool
) -> None:
    owner, spec = example(mode)
    spec = spec_with(spec, conntrack=LEAVE_ALONE, **changes)
    pod = pod_spec(builders.agent_daemonset(owner, spec, OPTS))
    (container,) = pod["containers"]
    paths = _host_paths(pod)
    flags = container["command"][5:]
    if mounted:
        assert paths.get(ROUTE_LOCALNET_NODE) == ROUTE_LOCALNET_POD
        assert flags == ["--route-localnet-file", ROUTE_LOCALNET_POD]
        (volume,) = [
            v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == ROUTE_LOCALNET_NODE
        ]
        assert volume["hostPath"]["type"] == "File"  # never created by the kubelet
    else:
        assert ROUTE_LOCALNET_NODE not in paths
        assert "--route-localnet-file" not in flags


# -- mode external ----------------------------------------------------------------------------


def test_external_backend_is_a_sidecar_sharing_the_state_socket_directory() -> None:
    owner, spec = example("external")
    pod = builders.agent_daemonset(owner, spec, OPTS)["spec"]["template"]["spec"]
    agent, backend = pod["containers"]
    assert backend["name"] == "backend" and backend["image"] == spec.external.image
    assert backend["command"] == ["python3", "/plugin/userspace_proxy.py"]
    assert {"name": "KPX_STATE_API", "value": "unix:/run/proxy-agent/state.sock"} in backend["env"]
    assert {"name": "PYTHONUNBUFFERED", "value": "1"} in backend["env"]
    assert backend["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}}
    assert backend["securityContext"] == {"runAsUser": 0}
    shared = {"name": "state-api", "mountPath": "/run/proxy-agent"}
    assert shared in agent["volumeMounts"] and backend["volumeMounts"] == [shared]
    assert {"name": "state-api", "emptyDir": {}} in pod["volumes"]
    assert agent["command"][:3] == ["proxy-agent", "--mode", "external"]
    assert agent["command"][-2:] == ["--state-socket", "/run/proxy-agent/state.sock"]


def test_no_sidecar_in_the_kernel_modes() -> None:
    owner, spec = example("nftables")
    spec = spec_with(spec, stateAPI={"enabled": True})
    pod = builders.agent_daemonset(owner, spec, OPTS)["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["agent"]
    assert all(v["name"] != "state-api" for v in pod["volumes"])


def test_external_sidecar_follows_the_socket_directory() -> None:
    owner, spec = example("external")
    spec = spec_with(spec, stateAPI={"enabled": True, "address": "unix:///var/run/kpx/s.sock"})
    pod = builders.agent_daemonset(owner, spec, OPTS)["spec"]["template"]["spec"]
    assert pod["containers"][1]["volumeMounts"] == [
        {"name": "state-api", "mountPath": "/var/run/kpx"}
    ]
    assert pod["containers"][0]["command"][-1] == "/var/run/kpx/s.sock"


def test_the_configmap_carries_the_generation_beside_the_configuration() -> None:
    """The agents report the generation they synced (ProxyNodeState); it changes no pod
    template (a spec change that only the ConfigMap carries rolls no agent)."""
    owner, spec = example("nftables")
    seven = Owner(owner.name, owner.uid, generation=7)
    data = builders.config_map(seven, spec, OPTS)["data"]
    assert data["generation"] == "7" and set(data) == {"config.yaml", "generation"}
    eight = Owner(owner.name, owner.uid, generation=8)
    ds = [builders.agent_daemonset(o, spec, OPTS) for o in (seven, eight)]
    assert ds[0]["spec"]["template"] == ds[1]["spec"]["template"]
    assert "generation" not in builders.config_map(owner, spec, OPTS)["data"]  # unknown: 0


@pytest.mark.parametrize("mode", ["nftables", "iptables", "ipvs", "external"])
def test_only_ipvs_agents_get_the_nodes_ipv4_sysctls_writable(mode: str) -> None:
    """Mode ipvs sets net.ipv4.vs.conntrack (else nothing masquerades what IPVS forwards) and
    the others; its pod's own /proc/sys is read-only, so the node's directory is mounted and
    named on the command line. No other mode gets it."""
    owner, spec = example(mode)
    pod = pod_spec(builders.agent_daemonset(owner, spec, OPTS))
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    if mode != "ipvs":
        assert "ipv4-sysctls" not in volumes and "--ipv4-sysctl-dir" not in container["command"]
        return
    assert volumes["ipv4-sysctls"]["hostPath"] == {
        "path": "/proc/sys/net/ipv4",
        "type": "Directory",
    }
    assert mounts["ipv4-sysctls"] == {
        "name": "ipv4-sysctls",
        "mountPath": "/host/proc/sys/net/ipv4",
    }
    assert "readOnly" not in mounts["ipv4-sysctls"]
    command = container["command"]
    assert command[command.index("--ipv4-sysctl-dir") + 1] == "/host/proc/sys/net/ipv4"
