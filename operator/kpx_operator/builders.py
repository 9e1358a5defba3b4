"""Pure builders: from a ProxyConfiguration spec to the objects the operator applies.

Every function returns plain dicts (JSON-ready, as server-side apply sends them) and does no
I/O. The golden files in tests/unit/golden/operator/ show the full output for each mode.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from kpx_api import (
    Mode,
    ProxyConfigurationSpec,
    agent_config_from_spec,
    dump_agent_config,
    parse_bind_address,
)
from kpx_api.agentconfig import AgentConfiguration, Rollback
from kpx_api.constants import CONFIG_GENERATION_KEY
from kpx_kube.credentials import APISERVER_ENDPOINTS_ENV

from . import __version__
from .cleanup import CLEANUP_LABEL
from .names import (
    AGENT_APP,
    AGENT_SERVICE_ACCOUNT,
    CLEANUP_APP,
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_KEY,
    DEFAULT_NAMESPACE,
    RESTART_HASH_ANNOTATION,
    child_labels,
    child_names,
    instance,
    labels,
    selector_labels,
)

Obj = dict[str, Any]

#: What the agent reads, and nothing more: Services, EndpointSlices, Namespaces (opt-out) and
#: Nodes (its own node's addresses and labels). The rules of the ClusterRole `kpx-agent`
#: installed with the operator (operator/manifests/agent-rbac.yaml, the chart): a unit test
#: checks both against this; the operator itself creates no role and no binding.
AGENT_RULES: Final[tuple[Obj, ...]] = (
    {
        "apiGroups": [""],
        "resources": ["services", "namespaces", "nodes"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Its own node's ProxyNodeState (an admission policy refuses any other node's).
    {"apiGroups": ["proxy.kpx.dev"], "resources": ["proxynodestates"], "verbs": ["create", "get"]},
    {
        "apiGroups": ["proxy.kpx.dev"],
        "resources": ["proxynodestates/status"],
        "verbs": ["get", "patch"],
    },
)

#: Fields of the agent's configuration file that the agent reloads while running (its
#: reload_config): the selected mode's tuning block, the namespace opt-out, and the networks
#: that feed its rules (a change triggers a full resync). Any other field (mode, bind
#: addresses, conntrack, detectLocal, and fields added later) is read at start only, so a
#: change to it changes the pod template and rolls the agents.
#: `rollback` is live too: the operator adds it when a switch of mode starts (when the mode,
#: and so the pod template, changes anyway) and removes it when the switch ends, which must not
#: roll every agent a second time.
LIVE_FIELDS: Final = frozenset(
    {
        "nftables",
        "iptables",
        "ipvs",
        "namespaceOptOut",
        "clusterCIDRs",
        "nodePortAddresses",
        "externalIPs",
        "rollback",
    }
)

#: Capabilities instead of `privileged`: nftables needs NET_ADMIN; iptables-restore and
#: ipvs (which uses iptables and ipset too) need NET_RAW as well.
CAPABILITIES: Final[dict[Mode, tuple[str, ...]]] = {
    Mode.NFTABLES: ("NET_ADMIN",),
    Mode.IPTABLES: ("NET_ADMIN", "NET_RAW"),
    Mode.IPVS: ("NET_ADMIN", "NET_RAW"),
    # State-server-only: no rules of its own, but at start it removes what agents of the
    # other modes left (a mode switch), which needs what they needed.
    Mode.EXTERNAL: ("NET_ADMIN", "NET_RAW"),
}
#: Modes that run iptables and so share the node's xtables lock file.
#: Mode external too: at start its agent removes what iptables agents left (a mode switch).
XTABLES_MODES: Final = frozenset({Mode.IPTABLES, Mode.IPVS, Mode.EXTERNAL})
XTABLES_LOCK: Final = "/run/xtables.lock"

#: spec.conntrack, when it changes anything (Conntrack.leaves_node_alone() false): the pod's own
#: /proc/sys is read-only (as with any unprivileged container), so the node's netfilter sysctls,
#: and with maxPerCore > 0 the nf_conntrack module's parameters (hashsize), are mounted
#: writable at other paths the agent is told about. Nothing else of /proc or /sys: no
#: `privileged` (upstream kube-proxy runs privileged for this).
CONNTRACK_SYSCTLS: Final = (
    "conntrack-sysctls",
    "/proc/sys/net/netfilter",
    "/host/proc/sys/net/netfilter",
)
CONNTRACK_MODULE: Final = (
    "conntrack-module",
    "/sys/module/nf_conntrack/parameters",
    "/host/sys/module/nf_conntrack/parameters",
)

#: Localhost NodePorts in effect (mode iptables, or nftables.localhostNodePorts): the agent
#: sets the node's net.ipv4.conf.all.route_localnet (as upstream), through this file only.
ROUTE_LOCALNET: Final = (
    "route-localnet",
    "/proc/sys/net/ipv4/conf/all/route_localnet",
    "/host/proc/sys/net/ipv4/conf/all/route_localnet",
)

#: Mode ipvs: the agent sets the node's net.ipv4.vs.conntrack (without it nothing masquerades
#: what IPVS forwards: a NodePort reached from another node's pod, with its endpoint there,
#: never answers), vs.expire_nodest_conn, vs.expire_quiescent_template and, with strictARP,
#: conf.all.arp_ignore and arp_announce, as upstream's ipvs mode does. The directory is
#: net/ipv4 rather than net/ipv4/vs: vs/ appears only once ip_vs is loaded, which the agent's
#: first IPVS request does, after the pod started.
IPV4_SYSCTLS: Final = (
    "ipv4-sysctls",
    "/proc/sys/net/ipv4",
    "/host/proc/sys/net/ipv4",
)

#: The agent image of this release (the operator's own version).
DEFAULT_AGENT_IMAGE: Final = f"ghcr.io/kpx/kpx-agent:{__version__}"

AGENT_CONTAINER: Final = "agent"
#: Mode external: the user's backend container (spec.external), next to the agent.
EXTERNAL_CONTAINER: Final = "backend"
CLEANUP_CONTAINER: Final = "cleanup"


@dataclass(frozen=True)
class Owner:
    """The ProxyConfiguration the children belong to."""

    name: str
    uid: str
    #: Its metadata.generation: in the agents' ConfigMap (CONFIG_GENERATION_KEY), so each
    #: agent reports which generation it synced (its ProxyNodeState); 0: unknown, left out.
    generation: int = 0


@dataclass(frozen=True)
class BuildOptions:
    """Operator-wide settings that shape the children."""

    namespace: str = DEFAULT_NAMESPACE
    #: host:port of the apiserver for the agents. Without a proxy on the node the Service IP
    #: in KUBERNETES_SERVICE_HOST does not answer yet, so a cluster without kube-proxy needs
    #: the real address. None: the kubelet's default (the kubernetes Service).
    apiserver_endpoint: str | None = None
    #: Without `apiserver_endpoint`: the apiserver's own addresses (host:port) from the
    #: `kubernetes` EndpointSlice (apiserver_endpoints.py), which the agents try before the
    #: Service VIP (KPX_APISERVER_ENDPOINTS).
    apiserver_endpoints: tuple[str, ...] = ()
    #: The agents' image unless spec.image overrides it: the agent of the operator's release
    #: (--agent-image, set by the chart and the manifests), so upgrading the operator rolls
    #: the agents to the same version.
    agent_image: str = DEFAULT_AGENT_IMAGE
    #: Secrets (in `namespace`) the agent and cleanup pods pull their image with.
    image_pull_secrets: tuple[str, ...] = ()
    #: The agents' ServiceAccount (in `namespace`), installed with the operator (--agent-
    #: service-account; the chart names it after its release's fullname).
    agent_service_account: str = AGENT_SERVICE_ACCOUNT
    #: Extra arguments appended to every agent's command line (--agent-arg, e.g. `-v`).
    agent_args: tuple[str, ...] = ()
    #: (key, value) annotations and labels of the agents' pods (--agent-pod-annotation,
    #: --agent-pod-label: the chart's agents.podAnnotations and podLabels); the operator's own
    #: labels and RESTART_HASH_ANNOTATION are not among them (cli refuses them).
    agent_pod_annotations: tuple[tuple[str, str], ...] = ()
    agent_pod_labels: tuple[tuple[str, str], ...] = ()
    #: (name, value) environment variables of every agent container (--agent-env: the chart's
    #: agents.extraEnv), after the operator's own (never one of their names: `operator_env`).
    agent_env: tuple[tuple[str, str], ...] = ()


#: The environment variables the operator sets on the agents (NODE_NAME, the pod's identity,
#: the apiserver's address) or may one day: names --agent-env may not take.
OPERATOR_ENV: Final = frozenset({"NODE_NAME"})
OPERATOR_ENV_PREFIXES: Final = ("POD_", "KUBERNETES_SERVICE_", "KPX_")


def operator_env(name: str) -> bool:
    """Whether the operator sets (or reserves) environment variable `name` on the agents."""
    return name in OPERATOR_ENV or name.startswith(OPERATOR_ENV_PREFIXES)


def _meta(owner: Owner, name: str, app: str, namespace: str | None = None) -> Obj:
    """Name, namespace and labels. No ownerReference: the operator's finalizer alone decides
    what deleting the ProxyConfiguration does (spec.deletionPolicy); with one, a garbage
    collector cascade (a foreground deletion, as Argo CD prunes by default) would delete the
    agents before the operator could orphan them or clean their nodes one by one."""
    meta: Obj = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = child_labels(owner.name, app)
    return meta


# -- configuration -------------------------------------------------------------------------------


def agent_config(
    spec: ProxyConfigurationSpec, rollback: Rollback | None = None
) -> AgentConfiguration:
    """The agents' configuration file, validated by the models the agent uses; `rollback`
    while a switch of mode runs (mode_switch.rollback)."""
    return agent_config_from_spec(spec, rollback)


def restart_hash(config: AgentConfiguration) -> str:
    """Hash of the part of the configuration the agent reads only at start (not LIVE_FIELDS)."""
    frozen = {k: v for k, v in config.to_dict().items() if k not in LIVE_FIELDS}
    # The operator's part of spec.takeover: the agents do not read it (no restart on a change).
    takeover = dict(frozen.get("takeover") or {})
    takeover.pop("moveKubeProxyOff", None)
    frozen["takeover"] = takeover
    text = json.dumps(frozen, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_map(
    owner: Owner, spec: ProxyConfigurationSpec, opts: BuildOptions, rollback: Rollback | None = None
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, child_names(owner.name).agent, AGENT_APP, opts.namespace),
        "data": {
            CONFIG_KEY: dump_agent_config(agent_config(spec, rollback)),
            **({CONFIG_GENERATION_KEY: str(owner.generation)} if owner.generation else {}),
        },
    }


# -- DaemonSets ----------------------------------------------------------------------------------


def _http_probe(path: str, bind_address: str, **timing: int) -> Obj:
    host, port = parse_bind_address(bind_address)
    get: Obj = {"path": path, "port": port}
    if host not in ("0.0.0.0", "::"):  # noqa: S104 - comparing, not binding
        # A specific address (e.g. 127.0.0.1): the kubelet, in the host network like the
        # pod, must call that address rather than the pod IP (= the node IP).
        get["host"] = host
    return {"httpGet": get, **timing}


def _agent_ports(spec: ProxyConfigurationSpec) -> list[Obj]:
    """The agent's ports: healthz, and metrics unless /metrics is on loopback only (a port a
    Prometheus PodMonitor names; 127.0.0.1 or ::1 is reachable from the node alone)."""
    _, healthz_port = parse_bind_address(spec.healthz_bind_address)
    ports: list[Obj] = [{"name": "healthz", "containerPort": healthz_port, "protocol": "TCP"}]
    host, metrics_port = parse_bind_address(spec.metrics_bind_address)
    if not ipaddress.ip_address(host).is_loopback and metrics_port != healthz_port:
        ports.append({"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"})
    return ports


def _security_context(mode: Mode) -> Obj:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": list(CAPABILITIES[mode])},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def agent_image(spec: ProxyConfigurationSpec, opts: BuildOptions) -> str:
    """The image of the agent and cleanup pods: spec.image when set, else the operator's."""
    return spec.image or opts.agent_image


def _pull_secrets(opts: BuildOptions) -> Obj:
    if not opts.image_pull_secrets:
        return {}
    return {"imagePullSecrets": [{"name": name} for name in opts.image_pull_secrets]}


def _resources(spec: ProxyConfigurationSpec) -> Obj:
    return {k: dict(v) for k, v in spec.resources.to_dict().items() if v}


def _placement(spec: ProxyConfigurationSpec) -> Obj:
    """Where the pods run: host network, priority, node selector and tolerations."""
    pod: Obj = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "priorityClassName": spec.priority_class_name,
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [t.to_dict() for t in spec.tolerations]
    return pod


def kept_out_affinity(nodes: Iterable[str]) -> Obj:
    """The pod spec's `affinity` keeping the pods off `nodes` by name (a node an older
    ProxyConfiguration selects too: admission.Admission.kept_out), or {} for none. The
    DaemonSet controller then runs no pod there and removes one that runs there."""
    names = sorted(set(nodes))
    if not names:
        return {}
    term = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": names}]}
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    }


def _xtables(mode: Mode) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts) for the node's xtables lock in the modes that run iptables."""
    if mode not in XTABLES_MODES:
        return [], []
    volume = {"name": "xtables-lock", "hostPath": {"path": XTABLES_LOCK, "type": "FileOrCreate"}}
    return [volume], [{"name": "xtables-lock", "mountPath": XTABLES_LOCK}]


def _conntrack_access(spec: ProxyConfigurationSpec) -> tuple[list[Obj], list[Obj], list[str]]:
    """(volumes, mounts, agent flags) that give the agent the node's conntrack settings, only
    those it may have to write (none when spec.conntrack leaves the node alone)."""
    if spec.conntrack.leaves_node_alone():
        return [], [], []
    needed = [CONNTRACK_SYSCTLS]
    flags = ["--conntrack-sysctl-dir", CONNTRACK_SYSCTLS[2]]
    if spec.conntrack.max_per_core > 0:  # nf_conntrack_max may need a bigger hashsize
        needed.append(CONNTRACK_MODULE)
        flags += ["--conntrack-hashsize-file", f"{CONNTRACK_MODULE[2]}/hashsize"]
    volumes = [{"name": n, "hostPath": {"path": p, "type": "Directory"}} for n, p, _ in needed]
    mounts = [{"name": n, "mountPath": m} for n, _, m in needed]
    return volumes, mounts, flags


def _host_path_access(
    host_path: tuple[str, str, str], kind: str, flag: str
) -> tuple[list[Obj], list[Obj], list[str]]:
    """(volumes, mounts, agent flags) for one node path (name, path, mount path) of type
    `kind`, mounted writable and named to the agent by `flag`."""
    name, path, mount = host_path
    return (
        [{"name": name, "hostPath": {"path": path, "type": kind}}],
        [{"name": name, "mountPath": mount}],
        [flag, mount],
    )


def _localnet_access(spec: ProxyConfigurationSpec) -> tuple[list[Obj], list[Obj], list[str]]:
    """(volumes, mounts, agent flags) for route_localnet, only where localhost NodePorts are
    in effect (mode iptables, or nftables with its opt-in: the mode's localhostNodePorts, and
    nodePortAddresses allowing 127.0.0.1)."""
    if not spec.localhost_node_ports_in_effect():
        return [], [], []
    return _host_path_access(ROUTE_LOCALNET, "File", "--route-localnet-file")


def _ipvs_sysctl_access(spec: ProxyConfigurationSpec) -> tuple[list[Obj], list[Obj], list[str]]:
    """(volumes, mounts, agent flags) for the node's net.ipv4 sysctls, in mode ipvs only."""
    if spec.mode is not Mode.IPVS:
        return [], [], []
    return _host_path_access(IPV4_SYSCTLS, "Directory", "--ipv4-sysctl-dir")


def _pod_env() -> list[Obj]:
    """The pod's identity (the agent records Events about its own Pod)."""
    return [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in (
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
            ("POD_UID", "metadata.uid"),
        )
    ]


def _apiserver_env(opts: BuildOptions) -> list[Obj]:
    if opts.apiserver_endpoint is None:
        if not opts.apiserver_endpoints:
            return []
        return [{"name": APISERVER_ENDPOINTS_ENV, "value": ",".join(opts.apiserver_endpoints)}]
    host, _, port = opts.apiserver_endpoint.rpartition(":")
    return [
        {"name": "KUBERNETES_SERVICE_HOST", "value": host.strip("[]")},
        {"name": "KUBERNETES_SERVICE_PORT", "value": port},
    ]


def _external_backend(
    spec: ProxyConfigurationSpec,
) -> tuple[list[Obj], list[Obj], list[str], list[Obj]]:
    """(volumes, agent mounts, agent flags, sidecars) of mode external: the user's backend
    container (spec.external) sharing the state socket's directory with the agent, an
    emptyDir. The socket's path is on the command line and in KPX_STATE_API (`unix:PATH`), as
    paths a runtime maps to the shared directory."""
    if spec.mode is not Mode.EXTERNAL or spec.external is None:
        return [], [], [], []
    ext, address = spec.external, spec.state_api.address
    mounts: list[Obj] = []
    volumes: list[Obj] = []
    flags: list[str] = []
    if address.startswith("unix://"):
        path = address[len("unix://") :]
        volumes = [{"name": "state-api", "emptyDir": {}}]
        mounts = [{"name": "state-api", "mountPath": posixpath.dirname(path)}]
        flags = ["--state-socket", path]
        address = f"unix:{path}"
    sidecar: Obj = {
        "name": EXTERNAL_CONTAINER,
        "image": ext.image,
        "imagePullPolicy": "IfNotPresent",
        **({"command": list(ext.command)} if ext.command else {}),
        **({"args": list(ext.args)} if ext.args else {}),
        "env": [
            {"name": "KPX_STATE_API", "value": address},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            *({"name": e.name, "value": e.value} for e in ext.env),
        ],
        "volumeMounts": mounts,
    }
    resources = {k: v for k, v in ext.resources.to_dict().items() if v}
    if resources:
        sidecar["resources"] = resources
    if security := ext.security_context.to_dict():
        sidecar["securityContext"] = security
    return volumes, mounts, flags, [sidecar]


def agent_daemonset(
    owner: Owner, spec: ProxyConfigurationSpec, opts: BuildOptions, kept_out: Iterable[str] = ()
) -> Obj:
    """The agents: one per selected node, `proxy-agent --mode M --config FILE`; none on the
    nodes `kept_out` (an older configuration selects them too)."""
    name = child_names(owner.name).agent
    xt_volumes, xt_mounts = _xtables(spec.mode)
    ct_volumes, ct_mounts, ct_flags = _conntrack_access(spec)
    ln_volumes, ln_mounts, ln_flags = _localnet_access(spec)
    vs_volumes, vs_mounts, vs_flags = _ipvs_sysctl_access(spec)
    ex_volumes, ex_mounts, ex_flags, sidecars = _external_backend(spec)
    container: Obj = {
        "name": AGENT_CONTAINER,
        "image": agent_image(spec, opts),
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "proxy-agent",
            "--mode",
            str(spec.mode),
            "--config",
            CONFIG_FILE,
            *ct_flags,
            *ln_flags,
            *vs_flags,
            *ex_flags,
            *opts.agent_args,
        ],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            *_pod_env(),
            *_apiserver_env(opts),
            *({"name": name, "value": value} for name, value in opts.agent_env),
        ],
        "ports": _agent_ports(spec),
        # /readyz: /healthz, and not before the agent's first verified sync, so a rolling
        # update (mode switch, upgrade) stops at a node whose new agent cannot program it.
        "readinessProbe": _http_probe(
            "/readyz",
            spec.healthz_bind_address,
            periodSeconds=5,
            failureThreshold=2,
            timeoutSeconds=2,
        ),
        # The liveness probe starts once /alivez first answers, within 5 min: an agent that
        # starts slowly (a loaded or emulated node: imports, the first lists) is not dead, and
        # a fixed initial delay would restart it before its first sync, again and again.
        "startupProbe": _http_probe(
            "/alivez",
            spec.healthz_bind_address,
            periodSeconds=2,
            failureThreshold=150,
            timeoutSeconds=5,
        ),
        # /alivez: fails only for what a restart fixes (a dead watch), not for a change the
        # kernel keeps refusing (/livez, upstream's): that would restart every agent at once.
        "livenessProbe": _http_probe(
            "/alivez",
            spec.healthz_bind_address,
            periodSeconds=10,
            failureThreshold=3,
            timeoutSeconds=5,
        ),
        "securityContext": _security_context(spec.mode),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            *xt_mounts,
            *ct_mounts,
            *ln_mounts,
            *vs_mounts,
            *ex_mounts,
        ],
    }
    if resources := _resources(spec):
        container["resources"] = resources
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(owner, name, AGENT_APP, opts.namespace),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name, AGENT_APP)},
            "updateStrategy": {
                "type": "RollingUpdate",
                # No surge: two agents of one node would share the host network and ports.
                "rollingUpdate": {"maxUnavailable": spec.max_unavailable, "maxSurge": 0},
            },
            "template": {
                "metadata": {
                    "labels": {**dict(opts.agent_pod_labels), **labels(owner.name, AGENT_APP)},
                    "annotations": {
                        **dict(opts.agent_pod_annotations),
                        RESTART_HASH_ANNOTATION: restart_hash(agent_config(spec)),
                    },
                },
                "spec": {
                    # Installed with the operator (names.AGENT_SERVICE_ACCOUNT), not created by it.
                    "serviceAccountName": opts.agent_service_account,
                    **_placement(spec),
                    **kept_out_affinity(kept_out),
                    **_pull_secrets(opts),
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container, *sidecars],
                    "volumes": [
                        {"name": "config", "configMap": {"name": name}},
                        *xt_volumes,
                        *ct_volumes,
                        *ln_volumes,
                        *vs_volumes,
                        *ex_volumes,
                    ],
                },
            },
        },
    }


def cleanup_daemonset(owner: Owner, spec: ProxyConfigurationSpec, opts: BuildOptions) -> Obj:
    """The short-lived cleanup (spec.deletionPolicy Cleanup): on each node the operator labels
    cleanup.CLEANUP_LABEL (one by one, once the node's agent is gone), remove the mode's rules,
    then turn Ready (answer /healthz) so the operator knows that node is clean."""
    xt_volumes, xt_mounts = _xtables(spec.mode)
    container: Obj = {
        "name": CLEANUP_CONTAINER,
        "image": agent_image(spec, opts),
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "proxy-agent",
            "cleanup",
            "--mode",
            str(spec.mode),
            "--then-serve-healthz",
            spec.healthz_bind_address,
        ],
        "readinessProbe": _http_probe(
            "/healthz", spec.healthz_bind_address, periodSeconds=2, timeoutSeconds=2
        ),
        "securityContext": _security_context(spec.mode),
    }
    if xt_mounts:
        container["volumeMounts"] = xt_mounts
    if resources := _resources(spec):
        container["resources"] = resources
    pod_spec: Obj = {
        # The cleanup does not talk to the apiserver: no token in the pod.
        "automountServiceAccountToken": False,
        **_placement(spec),
        **_pull_secrets(opts),
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if xt_volumes:
        pod_spec["volumes"] = xt_volumes
    pod_spec["nodeSelector"] = {
        **pod_spec.get("nodeSelector", {}),
        CLEANUP_LABEL: instance(owner.name),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(owner, child_names(owner.name).cleanup, CLEANUP_APP, opts.namespace),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name, CLEANUP_APP)},
            "template": {
                "metadata": {"labels": labels(owner.name, CLEANUP_APP)},
                "spec": pod_spec,
            },
        },
    }


def agent_children(
    owner: Owner,
    spec: ProxyConfigurationSpec,
    opts: BuildOptions,
    rollback: Rollback | None = None,
    kept_out: Iterable[str] = (),
) -> list[Obj]:
    """Everything the agents need, in apply order (the configuration before the pods). Their
    ServiceAccount and RBAC are installed with the operator. `rollback`: in the configuration
    while a switch of mode runs (it does not change the pod template). `kept_out`: nodes the
    agents stay off (a conflict with an older configuration)."""
    return [
        config_map(owner, spec, opts, rollback),
        agent_daemonset(owner, spec, opts, kept_out),
    ]


@dataclass(frozen=True)
class ChildRef:
    """Enough to find (and delete) a child."""

    kind: str
    name: str
    namespace: str | None


def child_refs(pxc_name: str, opts: BuildOptions) -> list[ChildRef]:
    """Every child of a ProxyConfiguration, in deletion order (pods first)."""
    names = child_names(pxc_name)
    ns = opts.namespace
    return [
        ChildRef("DaemonSet", names.agent, ns),
        ChildRef("DaemonSet", names.cleanup, ns),
        ChildRef("ConfigMap", names.agent, ns),
    ]
