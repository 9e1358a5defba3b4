"""The node-local model: pure functions from what the store holds to what backends program.

`types` holds the plain, frozen data every backend receives (NodeLocalState, ServicePort,
NodeFacts, DataplaneSettings); `service_ports` computes them from a Service, its
EndpointSlices and the Node; the other modules each decide one rule (VIP clashes, externalIPs,
detectLocal, quarantine, CIDR parsing), and `service_problems` records the Services left out
and why. Pure: no I/O, no clock (logging aside). Imports: the standard library and kpx_api
only; never the store, sync, handover, observability, conntrack or a backend.
"""
