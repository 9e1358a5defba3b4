"""Names of the ProxyConfiguration API: group, version, kinds and the CRD's names."""

from typing import Final

GROUP: Final = "proxy.kpx.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "proxy.kpx.dev/v1alpha1"  # f"{GROUP}/{VERSION}", spelled out for typing

KIND: Final = "ProxyConfiguration"
LIST_KIND: Final = "ProxyConfigurationList"
PLURAL: Final = "proxyconfigurations"
SINGULAR: Final = "proxyconfiguration"
SHORT_NAMES: Final = ("pxc",)
CATEGORIES: Final = ("kpx",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

AGENT_CONFIG_KIND: Final = "AgentConfiguration"

#: Namespaces carrying this label (with value "disabled") are opted out by the default selector.
OPT_OUT_LABEL: Final = "networking.k8s.io/kube-proxy"
OPT_OUT_VALUE: Final = "disabled"

#: Events the node agents record about their own Pod (source.component AGENT_EVENT_SOURCE),
#: for people: the operator reads what it needs from the agents' ProxyNodeStates instead.
AGENT_EVENT_SOURCE: Final = "kpx-agent"
CONNTRACK_NOT_APPLIED: Final = "ConntrackNotApplied"
CONNTRACK_APPLIED: Final = "ConntrackApplied"
#: An agent could not remove another proxy's rules from its node (it retries; the agent's
#: handover/make_before_break.py).
LEFTOVERS_NOT_REMOVED: Final = "LeftoversNotRemoved"
#: The agent removed another kpx mode's rules from its node after its first verified sync
#: (the message names the mode: "removed the rules of kpx mode iptables").
LEFTOVERS_REMOVED: Final = "LeftoversRemoved"
#: An agent removed what it could of another kpx mode's rules; the rest (kpx's IPVS virtual
#: servers) waits for the connections through it to end (takeover.Draining).
LEFTOVERS_DRAINING: Final = "LeftoversDraining"
#: How an agent names another kpx mode's rules in those messages (then the mode).
OTHER_MODE_RULES: Final = "the rules of kpx mode "
#: A sync failed to program the kernel (the message carries the error); the agent keeps the
#: previous rules and retries. Recorded when the error changes, at most once a minute otherwise.
SYNC_FAILED: Final = "SyncFailed"
#: spec.takeover.fromKubeProxy: the agent waits for kube-proxy's Pod to leave its node, then
#: removes kube-proxy's rules there.
WAITING_FOR_KUBE_PROXY: Final = "WaitingForKubeProxy"
KUBE_PROXY_RULES_REMOVED: Final = "KubeProxyRulesRemoved"
#: The agent's first full sync is programmed and verified in the kernel: it serves its node
#: (status.firstSyncVerified of its ProxyNodeState says the same to the operator).
FIRST_SYNC_VERIFIED: Final = "FirstSyncVerified"
#: During a switch of mode (its configuration's `rollback`): the agent had no verified sync in
#: its mode within the deadline and went back to the old mode (Warning; the message says why).
ROLLED_BACK: Final = "RolledBack"
#: Which modes the agent's node can run (kpx_api.preflight: the message's format).
MODE_PREFLIGHT: Final = "ModePreflight"

#: The agents' ConfigMap carries, beside the configuration file, this key: the
#: metadata.generation of the ProxyConfiguration it was rendered from (the agent reports the
#: generation it synced in its ProxyNodeState).
CONFIG_GENERATION_KEY: Final = "generation"
