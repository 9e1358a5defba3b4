"""explain-migration's findings: each ipvs-only setting or behaviour is named, with its
Services; a plain rr configuration without such Services gets only the switch itself."""

from __future__ import annotations

from typing import Any

from kpx_agent.handover.migration import explain, render
from kpx_api.modes import IPVSSettings


def svc(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "d", "name": name},
        "spec": {"clusterIP": "10.96.0.10", "type": "ClusterIP", **spec},
    }


SERVICES = [
    svc("plain"),
    svc("sticky", sessionAffinity="ClientIP"),
    svc("lb", type="LoadBalancer", externalTrafficPolicy="Local"),
    svc("headless", clusterIP="None"),
    svc("ext", type="ExternalName", clusterIP=None),
]


def topics(findings: list[Any]) -> dict[str, tuple[str, ...]]:
    return {f.topic: f.services for f in findings}


def test_every_ipvs_only_setting_and_behaviour_is_listed() -> None:
    settings = IPVSSettings.model_validate(
        {
            "acknowledgeDeprecation": True,
            "scheduler": "lc",
            "strictARP": True,
            "excludeCIDRs": ["192.0.2.0/24"],
            "tcpTimeout": "900s",
        }
    )
    found = topics(explain(settings, SERVICES))
    assert found["scheduler"] == ("d/plain", "d/sticky", "d/lb")  # headless/ExternalName: none
    assert "timeouts" in found and "strictARP" in found and "excludeCIDRs" in found
    assert found["session affinity"] == ("d/sticky",)
    assert found["externalTrafficPolicy Local"] == ("d/lb",)
    assert found["node addresses"] == ("d/lb",)
    text = render(explain(settings, SERVICES), len(SERVICES))
    assert "tcpTimeout=900s" in text and "lc" in text and "192.0.2.0/24" in text


def test_round_robin_defaults_only_name_the_switch() -> None:
    settings = IPVSSettings.model_validate({"acknowledgeDeprecation": True})
    assert list(topics(explain(settings, [svc("plain")]))) == ["switch"]
