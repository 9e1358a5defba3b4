"""kpx_operator: turns ProxyConfiguration objects into node-agent DaemonSets (kopf).

Layout (thin kopf handlers around pure functions, one I/O edge):

- `names`: names, labels and annotations of everything the operator creates.
- `builders`: pure functions from a spec to the desired child objects (plain dicts).
- `admission`: pure: may a ProxyConfiguration deploy (ipvs policy, node conflicts)?
- `status`: pure: the status (conditions) from the spec and what was observed.
- `apiserver`: the only module that talks to the apiserver (server-side apply, get, delete).
- `leader`: Lease-based leader election, so two replicas never act at once.
- `reconciler`: one reconcile pass and the deletion flow, built from the above.
- `handlers`: the kopf handlers (a few lines each) on an explicit registry.
- `cli`: `proxy-operator`.
"""

__version__ = "0.1.0"
