"""kpx node agent: watches the cluster, computes the node-local state, programs the kernel."""
