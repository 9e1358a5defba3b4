"""What the agent watches: four resources, each with the label selector upstream uses.

The list/watch itself is kpx_kube's `Reflector`.
"""

from __future__ import annotations

from kpx_kube.reflector import Resource

#: Upstream kube-proxy's selector, on both resources (its informers share one): a Service
#: that names another proxy, and the EndpointSlices that carry that label (the EndpointSlice
#: controller copies a Service's labels to its slices), are never sent; nor the slices of
#: headless Services.
PROXIED_SELECTOR = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
SERVICES_RESOURCE = Resource("services", "/api/v1/services", PROXIED_SELECTOR)
SLICES_RESOURCE = Resource(
    "endpointslices", "/apis/discovery.k8s.io/v1/endpointslices", PROXIED_SELECTOR
)
NAMESPACES_RESOURCE = Resource("namespaces", "/api/v1/namespaces")
NODES_RESOURCE = Resource("nodes", "/api/v1/nodes")
