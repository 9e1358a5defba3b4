"""The node simulator: plays the kubelet of simulated nodes (network namespaces of a
kpx_cluster.netns Topology) against a real apiserver.

- `simulator`: `NodeSimulator`, the nodes and their lifecycle (the entry point).
- `kubelet`: one node's Node object, lease and pod workers.
- `pod`: one pod's sandbox, volumes and containers; `container`: one container's process,
  restarts, probes and status; `process`: the processes; `probe`: readiness/liveness checks.
- `env`: a container's environment and paths; `volumes`: ConfigMap, Secret, projected token and
  hostPath volumes; `api`: the kubelet's HTTP client; `relay`: pods' access to the apiserver.
"""

from .pod import SimPod
from .simulator import NodeSimulator

__all__ = ["NodeSimulator", "SimPod"]
