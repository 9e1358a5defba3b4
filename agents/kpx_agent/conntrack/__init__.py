"""The kernel's connection tracking, shared by every mode.

`stale_flows` decides which UDP conntrack entries a sync made stale, `cleaner` deletes them off
the programming path, `wire` is the ctnetlink codec (pure) and `sysctl` sets the table's size
and timeouts (spec.conntrack). Imports: model and the mode-neutral kernel toolkit
(backends.kernel); never sync, handover, observability or the store.
"""
