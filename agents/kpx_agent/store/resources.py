"""What the agent watches: four resources, each with the label selector upstream kube-proxy
v1.36 uses. Its Services leave out those labelled for another proxy; its EndpointSlices only
those of headless Services. A slice's own `service-proxy-name` label does not matter (upstream
releases before it filtered both by it): whether a Service is proxied is decided by the
Service alone.

The list/watch itself is kpx_kube's `Reflector`.
"""

from __future__ import annotations

from kpx_kube.reflector import Resource

SERVICES_RESOURCE = Resource(
    "services", "/api/v1/services", "!service.kubernetes.io/service-proxy-name"
)
SLICES_RESOURCE = Resource(
    "endpointslices",
    "/apis/discovery.k8s.io/v1/endpointslices",
    "!service.kubernetes.io/headless",
)
NAMESPACES_RESOURCE = Resource("namespaces", "/api/v1/namespaces")
NODES_RESOURCE = Resource("nodes", "/api/v1/nodes")
