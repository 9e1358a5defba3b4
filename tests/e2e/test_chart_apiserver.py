"""The Helm chart against a real kube-apiserver: what `helm template` renders is accepted as it
is (server-side dry-run, so the apiserver's own validation of the ProxyConfiguration runs, CEL
rules included; the PodMonitor against a PodMonitor CRD with prometheus-operator's field
names), `helm install`/`uninstall` work, keeping the ProxyConfiguration and the CRD, and `helm
upgrade` upgrades the CRD: a field the installed chart's CRD lacked is then served and stored.

(Named test_chart_apiserver.py: pytest needs test file names unique across tests/unit and
tests/e2e, and tests/unit/test_chart.py exists.)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import Mode, ProxyConfigurationSpec
from kpx_cluster.controlplane import Cluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kpx"
CRD = "proxyconfigurations.proxy.kpx.dev"
RUN = secrets.token_hex(3)
LABEL = "pod-security.kubernetes.io/enforce"
#: A setting per mode that differs from its default (only the selected mode's is rendered).
MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "nftables": {"masqueradeBit": 12, "syncPeriod": "1m", "minSyncPeriod": "2s"},
    "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
    "ipvs": {"acknowledgeDeprecation": True, "scheduler": "wrr", "strictARP": True},
    "external": {"image": "example.com/proxy-backend:1.0", "args": ["--verbose"]},
}

OBJECT_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Deployment",
    "ProxyConfiguration",
    "FlowSchema",
    "PriorityLevelConfiguration",
    "CustomResourceDefinition",
    "PodDisruptionBudget",
    "PodMonitor",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
#: The kind the chart's CRD serves, for `helm template` (as on an installed cluster).
SERVED = ("--api-versions", "proxy.kpx.dev/v1alpha1/ProxyConfiguration")

#: prometheus-operator's PodMonitor, as far as the chart uses it: its group, version, kind and
#: field names (monitoring.coreos.com/v1, PodMonitorSpec, PodMetricsEndpoint, RelabelConfig,
#: Duration's pattern), without preserve-unknown-fields, so that a field the real CRD does not
#: know is refused here too (kubectl's strict field validation).
DURATION = (
    "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
RELABEL: Obj = {
    "type": "object",
    "properties": {
        "action": {
            "type": "string",
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ],
        },
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
    },
}
POD_MONITOR_CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PodMonitor",
            "listKind": "PodMonitorList",
            "plural": "podmonitors",
            "singular": "podmonitor",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["selector"],
                                "properties": {
                                    "jobLabel": {"type": "string"},
                                    "selector": {
                                        "type": "object",
                                        "properties": {
                                            "matchLabels": {
                                                "type": "object",
                                                "additionalProperties": {"type": "string"},
                                            },
                                            "matchExpressions": {
                                                "type": "array",
                                                "items": {
                                                    "type": "object",
                                                    "x-kubernetes-preserve-unknown-fields": True,
                                                },
                                            },
                                        },
                                    },
                                    "namespaceSelector": {
                                        "type": "object",
                                        "properties": {
                                            "any": {"type": "boolean"},
                                            "matchNames": {
                                                "type": "array",
                                                "items": {"type": "string"},
                                            },
                                        },
                                    },
                                    "podMetricsEndpoints": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "properties": {
                                                "port": {"type": "string"},
                                                "path": {"type": "string"},
                                                "scheme": {
                                                    "type": "string",
                                                    "enum": ["http", "https"],
                                                },
                                                "interval": {"type": "string", "pattern": DURATION},
                                                "scrapeTimeout": {
                                                    "type": "string",
                                                    "pattern": DURATION,
                                                },
                                                "relabelings": {"type": "array", "items": RELABEL},
                                                "metricRelabelings": {
                                                    "type": "array",
                                                    "items": RELABEL,
                                                },
                                            },
                                        },
                                    },
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}

Obj = dict[str, Any]


def helm_binary() -> Path:
    """The pinned helm (toolchain/helm/go.mod), built by `make setup`; missing: a failure."""
    go_mod = (REPO / "toolchain" / "helm" / "go.mod").read_text()
    pinned = re.search(r"^\s*(?:require\s+)?helm\.sh/helm/v3 (v\S+)$", go_mod, re.M)
    assert pinned is not None, "toolchain/helm/go.mod does not require helm.sh/helm/v3"
    cache = Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))
    path = cache / "bin" / pinned.group(1) / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm is not built ({path} missing): run `make setup`", pytrace=False)
    return path


class Helm:
    """The pinned helm against the session's cluster, with its own scratch config and cache."""

    def __init__(self, cluster: Cluster, home: Path) -> None:
        self.cluster = cluster
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
        for name in ("CONFIG", "CACHE", "DATA"):
            self.env[f"HELM_{name}_HOME"] = str(home / name.lower())
        self.env["KUBECONFIG"] = str(cluster.kubeconfig)

    def run(self, *args: str, values: Obj | None = None) -> subprocess.CompletedProcess[str]:
        extra = ["--values", "-"] if values is not None else []
        return subprocess.run(
            [str(helm_binary()), *args, *extra],
            input=json.dumps(values) if values is not None else None,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )

    def template(self, namespace: str, values: Obj) -> str:
        out = self.run(
            "template",
            "kpx",
            str(CHART),
            "--namespace",
            namespace,
            "--skip-tests",
            *SERVED,
            values=values,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout


@pytest.fixture(scope="module")
def helm(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    """The cluster with the CRD (crds/, as a user may have applied it) and a PodMonitor CRD
    installed and served."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(POD_MONITOR_CRD))
    for name in (CRD, POD_MONITOR_CRD["metadata"]["name"]):
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
    yield Helm(cluster, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh release namespace that allows privileged pods, as docs/helm.md says."""
    name = f"kpx-chart-{secrets.token_hex(3)}"
    cluster.create_namespace(name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=privileged")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def dry_run(cluster: Cluster, manifest: str) -> subprocess.CompletedProcess[str]:
    """`kubectl apply --server-side --dry-run=server`: admission and validation, no write."""
    return cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--force-conflicts",
        "--field-manager=kpx-chart-e2e",
        "-f",
        "-",
        input=manifest,
        check=False,
    )


def values_for(mode: str, name: str, **common: Any) -> Obj:
    agents: Obj = {"mode": mode, **MODE_SETTINGS}
    if common:
        agents["common"] = common
    return {"proxyConfiguration": {"name": name}, "agents": agents}


@pytest.mark.parametrize("mode", [m.value for m in Mode])
def test_rendered_chart_is_accepted(
    helm: Helm, cluster: Cluster, namespace: str, mode: str
) -> None:
    values = values_for(
        mode,
        f"chart-{RUN}-{mode}",
        clusterCIDRs=["10.244.0.0/16", "fd00:10:244::/56"],
        namespaceOptOut={"namespaces": ["legacy-proxy"]},
        maxUnavailable="10%",
    )
    values["operator"] = {"apiserverEndpoint": "192.0.2.10:6443", "ipvsPolicy": "deny"}
    values["monitoring"] = {
        "podMonitor": {
            "enabled": True,
            "interval": "15s",
            "metricRelabelings": [{"action": "labeldrop", "regex": "pod"}],
        }
    }
    manifest = helm.template(namespace, values)
    objects = [d for d in yaml.safe_load_all(manifest) if d]
    assert {o["kind"] for o in objects} == OBJECT_KINDS
    out = dry_run(cluster, manifest)
    assert out.returncode == 0, out.stderr
    applied = [
        ln for ln in out.stdout.splitlines() if ln.endswith("serverside-applied (server dry run)")
    ]
    assert len(applied) == len(objects), out.stdout


@pytest.mark.parametrize(
    ("common", "message"),
    [
        # Patterns pass (the values schema has them); the CRD's CEL rules do not.
        (
            {"clusterCIDRs": ["10.244.0.1/16"]},
            'spec.clusterCIDRs[0]: Invalid value: "10.244.0.1/16"',
        ),
        (
            {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Mi"}}},
            "spec.resources.requests: Invalid value: every request must be less than",
        ),
    ],
)
def test_cel_rules_still_apply(
    helm: Helm, cluster: Cluster, namespace: str, common: Obj, message: str
) -> None:
    """The dry-run is not vacuous: the apiserver refuses what only the CRD's CEL rules catch."""
    manifest = helm.template(namespace, values_for("nftables", f"chart-{RUN}-bad", **common))
    out = dry_run(cluster, manifest)
    assert out.returncode != 0
    assert "ProxyConfiguration" in out.stderr and message in out.stderr, out.stderr


def test_install_and_uninstall(helm: Helm, cluster: Cluster, namespace: str) -> None:
    """A real release: the objects exist, the stored spec is what the models make of it, NOTES
    say how to check it, and uninstall removes the operator but keeps the ProxyConfiguration
    and the CRD. The CRD was applied before (as from crds/): --take-ownership adopts it."""
    name = f"chart-{RUN}-install"
    release = f"kpx-{RUN}"
    values = values_for("nftables", name, clusterCIDRs=["10.244.0.0/16"])
    refused = helm.run("install", release, str(CHART), "--namespace", namespace, values=values)
    assert refused.returncode != 0
    assert f'CustomResourceDefinition "{CRD}"' in refused.stderr, refused.stderr
    assert "cannot be imported into the current release" in refused.stderr
    helm.run("uninstall", release, "--namespace", namespace, "--ignore-not-found")
    out = helm.run(
        "install", release, str(CHART), "--namespace", namespace, "--take-ownership", values=values
    )
    try:
        assert out.returncode == 0, out.stderr
        assert f"kubectl get pxc {name}" in out.stdout, out.stdout
        assert "WARNING" not in out.stdout, out.stdout  # the namespace allows privileged pods
        for kind in ("deployment", "serviceaccount", "role", "rolebinding", "poddisruptionbudget"):
            cluster.kubectl("-n", namespace, "get", kind, "kpx-operator")
        crd = json.loads(cluster.kubectl("get", "crd", CRD, "-o", "json").stdout)
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        for kind in ("clusterrole", "clusterrolebinding"):
            cluster.kubectl("get", kind, "kpx-operator")
        stored = json.loads(cluster.kubectl("get", "pxc", name, "-o", "json").stdout)
        assert stored["metadata"]["labels"]["app.kubernetes.io/instance"] == release
        spec = ProxyConfigurationSpec.model_validate(stored["spec"])
        assert stored["spec"] == spec.to_dict()  # the CRD's defaults are the models'
        assert spec.nftables is not None and spec.nftables.masquerade_bit == 12

        out = helm.run("uninstall", release, "--namespace", namespace)
        assert out.returncode == 0, out.stderr
        assert "kept due to the resource policy" in out.stdout + out.stderr, out
        gone = cluster.kubectl("-n", namespace, "get", "deployment", "kpx-operator", check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
        cluster.kubectl("get", "pxc", name)  # kept (helm.sh/resource-policy: keep)
        cluster.kubectl("get", "crd", CRD)  # kept too (crds.keep)
    finally:
        helm.run("uninstall", release, "--namespace", namespace, "--ignore-not-found")
        cluster.kubectl("delete", "pxc", name, "--ignore-not-found", check=False)


@pytest.mark.parametrize("level", [None, "baseline"])
def test_notes_warn_about_pod_security(helm: Helm, cluster: Cluster, level: str | None) -> None:
    """The agents need privileged pods: NOTES say so when the namespace does not allow them."""
    name = f"kpx-chart-{secrets.token_hex(3)}"
    cluster.create_namespace(name)
    if level is not None:
        cluster.kubectl("label", "namespace", name, f"pod-security.kubernetes.io/enforce={level}")
    try:
        out = helm.run(
            "install",
            f"kpx-{RUN}",
            str(CHART),
            "--namespace",
            name,
            "--dry-run=server",
            "--take-ownership",
        )
        assert out.returncode == 0, out.stderr
        said = "is not labelled" if level is None else f"is labelled {LABEL}={level}"
        assert f"WARNING: namespace {name} {said}" in out.stdout, out.stdout
        assert f"kubectl label namespace {name} {LABEL}=privileged --overwrite" in out.stdout
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


FLOW_CONTROL_KINDS = ("FlowSchema", "PriorityLevelConfiguration")


def test_flow_control_classifies_the_agents_requests(
    helm: Helm, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The chart's FlowSchema and PriorityLevelConfiguration, applied to the apiserver: a
    request as the agents' ServiceAccount (with its own token, as an agent makes it) is
    classified by them, as the apiserver's API Priority and Fairness headers say; before
    them, by the built-in service-accounts FlowSchema, shared with every tenant."""
    objects = [d for d in yaml.safe_load_all(helm.template(namespace, {})) if d]
    wanted = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", *FLOW_CONTROL_KINDS}
    agent = [o for o in objects if o["kind"] in wanted and o["metadata"]["name"] == "kpx-agent"]
    assert {o["kind"] for o in agent} == wanted
    first = [o for o in agent if o["kind"] not in FLOW_CONTROL_KINDS]
    flow = [o for o in agent if o["kind"] in FLOW_CONTROL_KINDS]

    def apply(objs: list[Obj]) -> None:
        manifest = "\n---\n".join(yaml.safe_dump(o) for o in objs)
        cluster.kubectl(
            "apply", "--server-side", "--field-manager=kpx-chart-e2e", "-f", "-", input=manifest
        )

    def uid(kind: str, name: str) -> str:
        out = cluster.kubectl("get", kind, name, "-o", "jsonpath={.metadata.uid}")
        return out.stdout.strip()

    try:
        apply(first)
        token = cluster.kubectl("create", "token", "kpx-agent", "-n", namespace).stdout.strip()
        bare = tmp_path / "no-credentials.kubeconfig"
        bare.write_text("apiVersion: v1\nkind: Config\n")

        def classified() -> str:
            """kubectl's log of the answer's headers (-v=8), for a request as the agent."""
            out = cluster.kubectl(
                f"--server={cluster.server}",
                f"--certificate-authority={cluster.ca_file}",
                f"--token={token}",
                "get",
                "services",
                "-A",
                "--chunk-size=1",
                "-v=8",
                kubeconfig=bare,
            )
            return out.stderr

        before = classified()
        assert uid("flowschema", "service-accounts") in before, before
        apply(flow)
        schema = uid("flowschema", "kpx-agent")
        level = uid("prioritylevelconfiguration", "kpx-agent")
        deadline = time.monotonic() + 60  # the apiserver's APF controller picks them up
        seen = before
        while schema not in seen and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = classified()
        assert schema in seen and level in seen, seen
    finally:
        for obj in reversed(agent):
            cluster.kubectl(
                "delete",
                obj["kind"].lower(),
                obj["metadata"]["name"],
                *(["-n", namespace] if obj["kind"] == "ServiceAccount" else []),
                "--ignore-not-found",
                check=False,
            )


# ---- CRD upgrades -------------------------------------------------------------------------------

#: The field the "old" chart's CRD lacks: no default and no CEL rule refers to it.
NEW_FIELD = "image"


def old_chart(tmp_path: Path) -> Path:
    """This chart as an older version whose CRD lacks spec.<NEW_FIELD>."""
    old = tmp_path / "kpx-old"
    shutil.copytree(CHART, old)
    crd_file = old / "templates" / "crds" / f"{CRD}.yaml"
    text = crd_file.read_text()
    # The template's YAML after its two template lines parses once the actions are removed.
    lines = [ln for ln in text.splitlines() if "{{" not in ln]
    crd = yaml.safe_load("\n".join(lines))
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        NEW_FIELD
    ]
    crd_file.write_text(
        "{{- if .Values.crds.install }}\n"
        + yaml.safe_dump(crd, sort_keys=False).replace(
            "metadata:\n", "metadata:\n  annotations:\n    helm.sh/resource-policy: keep\n", 1
        )
        + "{{- end }}\n"
    )
    chart = yaml.safe_load((old / "Chart.yaml").read_text())
    chart["version"] = "0.0.9"
    (old / "Chart.yaml").write_text(yaml.safe_dump(chart))
    return old


def delete_crd(cluster: Cluster) -> None:
    """Every CRD of crds/ (the chart ships them all: one left by another release would be
    refused as someone else's)."""
    names = [p.name.removesuffix(".yaml") for p in sorted((REPO / "crds").glob("*.yaml"))]
    cluster.kubectl("delete", "crd", *names, "--ignore-not-found", "--wait=true", "--timeout=60s")


def test_helm_upgrade_upgrades_the_crd(
    helm: Helm, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """From nothing: install a chart whose CRD lacks spec.image (the ProxyConfiguration comes as
    a post-install hook, once the CRD is served), where the field is unknown; `helm upgrade` to
    this chart, and the field is served (kubectl explain) and survives a round trip (applied,
    read back, not pruned); the hook-made ProxyConfiguration is now the release's own."""
    name = f"chart-{RUN}-crd"
    probe = f"chart-{RUN}-probe"
    release = f"kpx-{RUN}-crd"
    values = values_for("nftables", name)
    delete_crd(cluster)  # a cluster that never had kpx (the module's fixture applied crds/)
    try:
        out = helm.run(
            "install",
            release,
            str(old_chart(tmp_path)),
            "--namespace",
            namespace,
            "--wait=false",
            values=values,
        )
        assert out.returncode == 0, out.stderr
        stored = json.loads(cluster.kubectl("get", "pxc", name, "-o", "json").stdout)
        assert stored["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
        explained = cluster.kubectl("explain", f"proxyconfigurations.spec.{NEW_FIELD}", check=False)
        assert explained.returncode != 0, explained.stdout
        pxc = {
            "apiVersion": "proxy.kpx.dev/v1alpha1",
            "kind": "ProxyConfiguration",
            "metadata": {"name": probe},
            "spec": {
                "mode": "nftables",
                "nodeSelector": {"kpx.dev/none": "probe"},
                NEW_FIELD: "registry.example/kpx-agent:probe",
            },
        }
        unknown = cluster.kubectl(
            "apply",
            "--server-side",
            "--field-manager=kpx-chart-e2e",
            "-f",
            "-",
            input=json.dumps(pxc),
            check=False,
        )
        assert (
            unknown.returncode != 0
            and f".spec.{NEW_FIELD}: field not declared in schema" in unknown.stderr
        ), unknown.stdout + unknown.stderr

        out = helm.run("upgrade", release, str(CHART), "--namespace", namespace, values=values)
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 60  # the apiserver republishes the CRD's OpenAPI
        while True:
            explained = cluster.kubectl(
                "explain", f"proxyconfigurations.spec.{NEW_FIELD}", check=False
            )
            if explained.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert explained.returncode == 0, explained.stderr
        assert "Container image of the agents" in explained.stdout
        cluster.kubectl(
            "apply",
            "--server-side",
            "--field-manager=kpx-chart-e2e",
            "-f",
            "-",
            input=json.dumps(pxc),
        )
        back = json.loads(cluster.kubectl("get", "pxc", probe, "-o", "json").stdout)
        assert back["spec"][NEW_FIELD] == "registry.example/kpx-agent:probe"
        crd = json.loads(cluster.kubectl("get", "crd", CRD, "-o", "json").stdout)
        assert crd["metadata"]["labels"]["helm.sh/chart"] == "kpx-0.1.0"
        manifest = helm.run("get", "manifest", release, "--namespace", namespace).stdout
        assert f"name: {name}" in manifest  # adopted: an ordinary object of the release now
        hooks = helm.run("get", "hooks", release, "--namespace", namespace).stdout
        assert "kind: ProxyConfiguration" not in hooks  # no hook any more

        out = helm.run("uninstall", release, "--namespace", namespace)
        assert out.returncode == 0, out.stderr
        cluster.kubectl("get", "crd", CRD)
        cluster.kubectl("get", "pxc", name)
    finally:
        helm.run("uninstall", release, "--namespace", namespace, "--ignore-not-found")
        for pxc_name in (name, probe):
            cluster.kubectl("delete", "pxc", pxc_name, "--ignore-not-found", check=False)
        # Leave the CRD as the module's fixture made it (without the release's ownership).
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
