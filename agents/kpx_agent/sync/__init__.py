"""The sync loop: take the store's recorded changes, recompute the model, program the kernel.

`loop` paces the syncs (minSyncPeriod, the periodic resync, retries) and reports their
outcome; `proxier` runs one sync through the mode's backend; `fault_isolation` finds the
Services a kernel refuses; `sync_log` writes one line per sync. Imports: model, store,
backends (the contract and the registry's backend object), conntrack, observability; never
handover.
"""
