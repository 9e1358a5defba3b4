"""A backend driven step by step inside a node netns, for the ipvs kernel tests.

Run as `python3 ipvs_driver.py MODE` inside the node's netns; each line on stdin is a JSON step
{"services": [...], "changed": [keys] | null, "settings": {...}, "cleanup": bool,
"remove_other_modes": bool}, or {"case": NAME, "world": {...}} for a case of the shared
semantics matrix (tests/unit/semantics.py: its ports and settings, a full sync); the driver
applies it and answers one JSON line on stdout.
"""

from __future__ import annotations

import json
import logging
import sys
from ipaddress import ip_network
from pathlib import Path
from typing import Any

from kpx_agent import backends
from kpx_agent.model.service_ports import local_state
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    IPVSOptions,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortKey,
)


def _key(raw: list[Any]) -> ServicePortKey:
    return ServicePortKey(raw[0], raw[1], "", Protocol(raw[2]), 4)


def _endpoints(raw: list[list[Any]]) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(IP.of(e[0]), int(e[1]), bool(e[2]) if len(e) > 2 else False) for e in raw)


def _port(raw: dict[str, Any]) -> ServicePort:
    eps = _endpoints(raw.get("endpoints", []))
    ext = _endpoints(raw["external"]) if "external" in raw else eps
    return ServicePort(
        _key(raw["key"]),
        int(raw["port"]),
        cluster_ips=tuple(IP.of(ip) for ip in raw.get("cluster_ips", [])),
        node_port=int(raw.get("node_port", 0)),
        cluster_endpoints=eps,
        external_endpoints=ext,
        external_masquerade=bool(raw.get("external_masquerade", True)),
        drop_when_no_cluster_endpoints=bool(raw.get("drop", False)),
        drop_when_no_external_endpoints=bool(raw.get("drop_external", False)),
        affinity_timeout=int(raw.get("affinity", 0)),
    )


def _settings(raw: dict[str, Any]) -> DataplaneSettings:
    if "spec" in raw:  # a ProxyConfiguration's spec fields, resolved as the agent does
        from kpx_agent import settings as settings_mod

        return settings_mod.resolve(settings_mod.load("ipvs", None, raw["spec"])).proxy
    return DataplaneSettings(
        cluster_cidrs=(ip_network("10.244.0.0/16"),),
        ipvs=IPVSOptions(
            scheduler=raw.get("scheduler", "rr"),
            strict_arp=bool(raw.get("strict_arp", False)),
            exclude_cidrs=tuple(ip_network(c) for c in raw.get("exclude_cidrs", [])),
            tcp_timeout=int(raw.get("tcp_timeout", 0)),
            tcp_fin_timeout=int(raw.get("tcp_fin_timeout", 0)),
            udp_timeout=int(raw.get("udp_timeout", 0)),
        ),
    )


def _matrix_case(name: str, world: dict[str, Any]) -> tuple[DataplaneSettings, Any]:
    """The settings and node-local state of one case of the shared semantics matrix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import semantics

    w = semantics.World(**world)
    case = next(c for c in semantics.CASES if c.name == name)
    settings = semantics.settings_of(case, w)
    return settings, local_state(semantics.node_of(w), settings, case.ports(w))


class _SwapFallbacks(logging.Handler):
    """Warnings that a table's swap in place was refused (and replaced whole): none is
    expected in these tests, so a step that logs one answers not ok."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cannot swap its contents in place" in message:
            self.seen.append(message)


def main() -> None:
    mode, node_name, node_ip = sys.argv[1:4]
    fallbacks = _SwapFallbacks()
    logging.getLogger().addHandler(fallbacks)
    module = backends.load(mode)
    backend = None
    node = NodeInfo(node_name, (IP.of(node_ip),))
    for line in sys.stdin:
        step = json.loads(line)
        answer: dict[str, Any] = {"ok": True}
        try:
            if step.get("cleanup"):
                module.cleanup()
            if "case" in step:
                settings, state = _matrix_case(step["case"], step["world"])
                if backend is None:
                    backend = module.create(settings)
                backend.reconfigure(settings)
                backend.sync(state, None)
            if "services" in step:
                settings = _settings(step.get("settings", {}))
                if backend is None:
                    backend = module.create(settings)
                backend.reconfigure(settings)
                ports = [_port(p) for p in step["services"]]
                changed = step.get("changed")
                state = local_state(node, settings, ports)
                backend.sync(state, None if changed is None else [_key(k) for k in changed])
                if hasattr(backend, "draining"):
                    answer["draining"] = sum(len(v) for v in backend.draining().values())
            if step.get("remove_other_modes"):  # after the sync, as the agent does
                # Imported here: the agent's CLI costs about 10 s to import under the guest's
                # emulated CPU, and most steps never need it.
                from kpx_agent.cli import remove_other_modes

                remove_other_modes(mode)
        except Exception as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if fallbacks.seen:
            answer = {"ok": False, "error": f"a swap in place was refused: {fallbacks.seen}"}
            fallbacks.seen = []
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
