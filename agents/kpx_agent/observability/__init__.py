"""What the agent tells the world: metrics, health and readiness, Events, ProxyNodeState.

`metrics` (Prometheus), `proxy_health` (the proxier health decisions, pure) and
`http_endpoints` (/healthz, /readyz, /metrics), `service_health` (healthCheckNodePort
servers), `pod_events` (Events about the agent's Pod), `node_state` (this node's
ProxyNodeState, pure) and `node_state_writer` (its I/O edge). Imports: model and store; never
sync, handover, conntrack or a backend (the sync loop reports to these, not the reverse).
"""
