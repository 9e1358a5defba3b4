"""The store: what the agent knows of the cluster, and what it watches.

Watch handlers record Services, EndpointSlices, Namespaces and the Node here (compact forms of
the fields the agent reads); the sync loop takes the changes out. Imports: the standard library,
kpx_api, and `model` (for label and annotation names); never sync, handover, observability,
conntrack or a backend.
"""
