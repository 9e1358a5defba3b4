"""The apiserver's own addresses, for the agents (pure).

An agent must never need a Service VIP to reach the apiserver: after a node reboot in a
cluster without kube-proxy nothing answers the `kubernetes` Service's IP until the agent has
programmed it, and the agent cannot program it before it reached the apiserver. The apiserver
publishes its own addresses in the `default/kubernetes` EndpointSlice; the operator hands them
to the agents (KPX_APISERVER_ENDPOINTS, tried before KUBERNETES_SERVICE_HOST: kpx_kube's
`in_cluster`). `--apiserver-endpoint` (chart: operator.apiserverEndpoint) overrides them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Final

#: The EndpointSlice the apiserver keeps for the `kubernetes` Service (its endpoint reconciler
#: names it after the Service), in the `default` namespace.
SLICE_NAME: Final = "kubernetes"
SLICE_NAMESPACE: Final = "default"
#: How long the operator reuses what it read (the addresses change when control-plane nodes
#: come and go, which is rare; a change rolls the agents, node by node).
REFRESH_SECONDS: Final = 60.0


def endpoints_of(slice_obj: Mapping[str, Any] | None) -> tuple[str, ...]:
    """`host:port` (`[v6]:port`) of the slice's ready addresses on its `https` port (its only
    port when unnamed), sorted so that the same set always renders the same pod template."""
    if not slice_obj:
        return ()
    ports = [p for p in slice_obj.get("ports") or [] if isinstance(p, Mapping)]
    port = next((p for p in ports if p.get("name") == "https"), ports[0] if ports else None)
    number = (port or {}).get("port")
    if not isinstance(number, int) or not 0 < number < 65536:
        return ()
    out: set[str] = set()
    for endpoint in slice_obj.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            try:
                ip = ipaddress.ip_address(str(address))
            except ValueError:
                continue  # not an address: never pasted into the agents' environment
            if ip.is_loopback or ip.is_unspecified:
                continue  # the apiserver's loopback is not the agents'
            out.add(f"[{ip}]:{number}" if ip.version == 6 else f"{ip}:{number}")
    return tuple(sorted(out))
