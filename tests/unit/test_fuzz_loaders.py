"""Fuzz the loaders that read what a person or a cluster hands the agent (issue #22, "hostile
and random input"): the agent's configuration file and kubeconfigs. Whatever the input, a
loader either returns its result or raises its own error naming the problem; any other
exception (KeyError, TypeError, AttributeError, ...) is a crash at start, which this finds.

Documents are built from each format's own vocabulary, so they reach the deep fields rather
than failing at the first key, plus arbitrary text for the YAML layer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kpx_api.agentconfig import parse_agent_config, parse_agent_config_text
from kpx_api.errors import ConfigError
from kpx_kube.kubeconfig import KubeconfigError, parse

# Derandomized: the same examples on every run, so CI never fails on a new random find (a
# local run with `--hypothesis-seed=random` or more examples explores further).
FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        [
            "nftables",
            "iptables",
            "ipvs",
            "external",
            "30s",
            "1m",
            "-1s",
            "10.0.0.0/8",
            "::/0",
            "0.0.0.0:10256",
            "[::]:1",
            "ClusterCIDR",
            "true",
            "",
            "∞",
        ]
    ),
)


def documents(keys: list[str]) -> st.SearchStrategy[Any]:
    """Nested mappings and lists whose keys come from `keys` (and a few strangers)."""
    key = st.one_of(st.sampled_from(keys), st.text(max_size=8))
    return st.recursive(
        SCALARS,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(key, inner, max_size=6),
        ),
        max_leaves=25,
    )


AGENT_KEYS = [
    "apiVersion",
    "kind",
    "mode",
    "nftables",
    "iptables",
    "ipvs",
    "external",
    "syncPeriod",
    "minSyncPeriod",
    "masqueradeBit",
    "masqueradeAll",
    "localhostNodePorts",
    "scheduler",
    "strictARP",
    "tcpTimeout",
    "acknowledgeDeprecation",
    "image",
    "conntrack",
    "maxPerCore",
    "min",
    "tcpEstablishedTimeout",
    "clusterCIDRs",
    "nodePortAddresses",
    "detectLocal",
    "bindAddresses",
    "healthz",
    "metrics",
    "namespaceOptOut",
    "namespaces",
    "labelSelector",
    "rollback",
    "progressDeadlineSeconds",
    "enabled",
    "stateAPI",
]


@FUZZ
@given(documents(AGENT_KEYS))
def test_agent_configuration_documents_parse_or_say_which_field(doc: Any) -> None:
    doc = (
        {"apiVersion": "proxy.kpx.dev/v1alpha1", "kind": "AgentConfiguration", **doc}
        if isinstance(doc, dict)
        else doc
    )
    try:
        parse_agent_config(doc, "fuzz")
    except ConfigError as exc:
        assert exc.errors and str(exc).startswith("fuzz: ")


@FUZZ
@given(st.text(max_size=200))
def test_agent_configuration_text_parses_or_is_refused(text: str) -> None:
    try:
        parse_agent_config_text(text, "fuzz")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz")


@FUZZ
@given(documents(AGENT_KEYS))
def test_agent_configuration_yaml_round_trip(doc: Any) -> None:
    """Through the YAML text the operator writes into the ConfigMap and the agent reads."""
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    with contextlib.suppress(ConfigError):
        parse_agent_config_text(text, "fuzz")


KUBECONFIG_KEYS = [
    "apiVersion",
    "kind",
    "clusters",
    "cluster",
    "users",
    "user",
    "contexts",
    "context",
    "name",
    "current-context",
    "server",
    "certificate-authority",
    "certificate-authority-data",
    "insecure-skip-tls-verify",
    "disable-compression",
    "extensions",
    "extension",
    "client-certificate",
    "client-certificate-data",
    "client-key",
    "client-key-data",
    "token",
    "tokenFile",
    "exec",
    "command",
    "args",
    "env",
    "value",
    "installHint",
    "provideClusterInfo",
    "interactiveMode",
    "proxy-url",
    "tls-server-name",
    "auth-provider",
    "username",
    "password",
    "as",
    "namespace",
]


def kubeconfigs() -> st.SearchStrategy[Any]:
    """Documents shaped like kubeconfigs (named lists of clusters, users, contexts, contexts
    that name them, servers that are URLs) with fuzzed content, and wholly random ones."""
    names = st.sampled_from(["a", "b", ""])
    fuzzed = documents(KUBECONFIG_KEYS)
    cluster = st.one_of(
        fuzzed,
        st.fixed_dictionaries(
            {"server": st.sampled_from(["https://h", "http://h:1"])},
            optional={"extensions": fuzzed, "exec": fuzzed, "certificate-authority-data": SCALARS},
        ),
    )
    user = st.one_of(
        fuzzed,
        st.fixed_dictionaries(
            {},
            optional={
                "exec": fuzzed,
                "token": SCALARS,
                "tokenFile": SCALARS,
                "client-key-data": SCALARS,
                "client-certificate-data": SCALARS,
            },
        ),
    )
    context = st.one_of(fuzzed, st.fixed_dictionaries({"cluster": names, "user": names}))

    def named(field: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.lists(st.fixed_dictionaries({"name": names, field: value}), max_size=3)

    shaped = st.fixed_dictionaries(
        {
            "clusters": named("cluster", cluster),
            "users": named("user", user),
            "contexts": named("context", context),
            "current-context": st.sampled_from(["a", "b", "", None]),
        }
    )
    return st.one_of(shaped, fuzzed)


@FUZZ
@given(kubeconfigs(), st.sampled_from([None, "a", "b"]))
# Found by this test: names that are not strings raised TypeError (unhashable list).
@example({"current-context": [None]}, None)
@example({"contexts": [{"name": "a", "context": {"cluster": ["a"]}}]}, "a")
@example({"contexts": [{"name": ["a"]}]}, "a")
def test_kubeconfig_documents_parse_or_say_which_field(doc: Any, context: str | None) -> None:
    try:
        parse(doc, Path("/nonexistent/kube"), context)
    except KubeconfigError as exc:
        assert str(exc)
