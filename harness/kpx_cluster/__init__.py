"""kpx_cluster: local control plane, netns topology toolkit and test helpers for kpx."""
