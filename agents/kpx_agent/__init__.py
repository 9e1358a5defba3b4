"""kpx node agent: watches the cluster, computes the node-local state, programs the kernel."""

#: The agent's version (agents/pyproject.toml's; the ProxyNodeState shows it).
__version__ = "0.1.0"
